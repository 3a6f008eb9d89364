"""``bench/ckpt_bench.py``'s verdict on a missed memory-restore bar names the limit that sets it, from the
two least-work reads measured beside the restore (medians of real ``--memory --repeat 7`` runs)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

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


def test_the_inherited_copy_is_read_by_a_forked_child_and_checked() -> None:
    # bench/limits/inherited_bar.py: a child forked by the holder copies and hashes the inherited bytes in
    # one pass (its copy and digest checked against the bytes' own, else it fails), then the holder writes
    script = Path(__file__).resolve().parents[2] / "bench" / "limits" / "inherited_bar.py"
    proc = subprocess.run([sys.executable, str(script), "--gib", "0.02", "--rounds", "1"], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    if "n/a (" in proc.stdout:   # no compiler or no AVX2: said, nothing measured
        return
    ratios = re.findall(r"one pass / torch copy_ \(memcpy s / this s\): ([0-9.]+)", proc.stdout)
    writes = re.findall(r"after / never forked: ([0-9.]+)", proc.stdout)
    assert len(ratios) == len(writes) == 2 and all(float(x) > 0 for x in ratios + writes), proc.stdout
    assert "dropped the inherited pages" in proc.stdout and "still maps the inherited pages" in proc.stdout


def test_the_memory_restore_bar_is_measured_in_a_trainer_the_holder_forks(tmp_path: Path) -> None:
    # bench/ckpt_bench.py --memory, small: the holder of the copies (a process of its own, as the standby
    # server) forks a trainer each round, which restores from the copies it inherited beside its memcpy
    script = Path(__file__).resolve().parents[2] / "bench" / "ckpt_bench.py"
    out = tmp_path / "figures.json"
    before = set(Path("/dev/shm").glob("omni-*/bench-*"))
    proc = subprocess.run([sys.executable, str(script), "--memory", "--gib", "0.03", "--tensors", "30",
                           "--repeat", "1", "--dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    runs = figures["runs"]
    assert len(runs["memcpy_trainer_s"]) == 2 and len(runs["memory_restore_s"]) == 1, runs
    assert len(runs["keeper_restore_s"]) == 1   # and the restore read from another process, beside it
    assert "memory restores read from memory (inherited)" in proc.stdout, proc.stdout[-3000:]
    assert re.search(r"^memory restore / warm memcpy +[0-9.]+ +>= 0.9", proc.stdout, re.MULTILINE), proc.stdout[-3000:]
    assert set(Path("/dev/shm").glob("omni-*/bench-*")) <= before   # the job's folder freed at the end
