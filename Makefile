.PHONY: setup demo test lint spank test-slurm-versions
setup:
	bash scripts/setup.sh
demo:
	bash scripts/demo.sh
test:
	bash scripts/test.sh
# The version lane: the tests that cross the Slurm boundary on Slurm 24.11 and 26.05 (README).
test-slurm-versions:
	OMNI_SLURM_VERSION=24.11 bash scripts/test.sh
	OMNI_SLURM_VERSION=26.05 bash scripts/test.sh
spank:
	$(MAKE) -C spank
lint:
	.venv/bin/ruff check slurm_omni tests bench
	.venv/bin/mypy
