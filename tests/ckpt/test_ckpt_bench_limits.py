"""``bench/ckpt_bench.py``'s verdict on a missed memory-restore bar names the limit that sets it, from the
two least-work reads measured beside the restore (medians of real ``--memory --repeat 7`` runs)."""

from __future__ import annotations

import pytest

from bench.ckpt_bench import CHECKED_HOW, memory_limit

KEEPER = "the keeper's memory (process_vm_readv)"
WALL = "memory restore / warm memcpy"
CPU = "memory restore CPU: memcpy CPU s / restore CPU s"


@pytest.mark.parametrize(("name", "med", "verdict", "figures"), [
    # 13:53: the raw read is above the bar in CPU, the checked read below it
    (CPU, {"memcpy_cpu_s": 0.1152, "raw_shm_read_cpu_s": 0.1122, "checked_shm_read_cpu_s": 0.1295},
     "the checksum sets the limit", ("1.03", "0.89", "in CPU s")),
    # the same run in wall time: the load slowed even the raw read below the bar
    (WALL, {"memcpy_s": 0.0775, "raw_shm_read_s": 0.1552, "checked_shm_read_s": 0.1299},
     "the machine's copy sets the limit here", ("0.50", "0.60")),
    # both reads above the bar: what is left is the restore's own
    (WALL, {"memcpy_s": 0.1, "raw_shm_read_s": 0.095, "checked_shm_read_s": 0.105},
     "the restore's own cost misses it", ("1.05", "0.95")),
])
def test_a_missed_bar_names_the_limit_that_sets_it(name: str, med: dict[str, float], verdict: str,
                                                   figures: tuple[str, ...]) -> None:
    line = memory_limit(med, name, 0.9, "tmpfs rw", KEEPER)
    assert line.endswith(f"{verdict})"), line
    assert "process_vm_readv" in line and "no manifest, no tensors" in line
    for figure in figures:
        assert figure in line, (figure, line)


def test_without_the_reads_measured_nothing_is_claimed() -> None:
    assert memory_limit({"memcpy_s": 0.1}, WALL, 0.9, "tmpfs rw", KEEPER) == ""


def test_tmpfs_copies_name_their_pages() -> None:
    line = memory_limit({"memcpy_s": 0.1, "raw_shm_read_s": 0.2}, WALL, 0.9, "tmpfs rw", "tmpfs files (preadv)")
    assert "4 KiB pages" in line and "huge=within_size" in line and line.endswith("sets the limit here)")


def test_the_checked_read_says_it_ran_the_restores_own_loop() -> None:
    line = memory_limit({"memcpy_s": 0.1, "raw_shm_read_s": 0.095, "checked_shm_read_s": 0.105}, WALL, 0.9,
                        "tmpfs rw", KEEPER, checked_how=CHECKED_HOW[True])
    assert "the restore's C loop over its pieces into one buffer" in line and line.endswith("own cost misses it)")
