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
	@# the scale lane's C rank, with the flags bench/light_build.py compiles it with (no compiler: skipped)
	@if command -v $${CC:-cc} >/dev/null; then $${CC:-cc} -fsyntax-only -O2 -std=gnu11 -Wall -Wextra -Werror \
		-Wformat=2 -Wshadow -D_FORTIFY_SOURCE=2 bench/light_rank.c bench/light_relay.c bench/light_io.c; else echo "lint: no C compiler, the C light rank not checked"; fi
	@# the memory tier's C restore loop, with slurm_omni/checkpoint/held_native.py's flags
	@if command -v $${CC:-cc} >/dev/null; then $${CC:-cc} -fsyntax-only -O3 -std=gnu11 -Wall -Wextra -Werror \
		-Wformat=2 -Wshadow -D_FORTIFY_SOURCE=2 slurm_omni/checkpoint/csrc/held_read.c; else echo "lint: no C compiler, the C restore loop not checked"; fi
	.venv/bin/mypy
