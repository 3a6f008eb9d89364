.PHONY: setup demo test lint spank
setup:
	bash scripts/setup.sh
demo:
	bash scripts/demo.sh
test:
	bash scripts/test.sh
spank:
	$(MAKE) -C spank
lint:
	.venv/bin/ruff check slurm_omni tests bench
	.venv/bin/mypy
