"""bench/cpu_share.py, the scale bench's CPU per process class: a busy light rank counts as a rank,
and what a parent's children burned between two samples (seen by none) counts as the parent's class,
once, also through a subshell that is gone too."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench.cpu_share import CLASSES, Sampler, other_name, others_line, share_line

SPIN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def test_a_busy_process_counts_in_its_class_and_a_gone_subshell_s_children_once(tmp_path: Path) -> None:
    rank = tmp_path / "light_rank.py"
    rank.write_text(SPIN.format(s=0.6))
    sampler = Sampler(light_rank=str(rank), bench_pid=os.getpid(), interval_s=0.2)
    sampler.sample()
    proc = subprocess.Popen([sys.executable, "-S", str(rank)])
    time.sleep(0.1)
    sampler.sample()   # the rank seen once while it runs
    # short children of a subshell of ours: both gone before any sample sees them
    subprocess.run(["bash", "-c", f"( {sys.executable} -S -c '{SPIN.format(s=0.3)}' ); true"], check=True)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)   # ended, not reaped: its stat holds its total
    sampler.sample()
    proc.wait()
    sampler.sample()
    assert set(sampler.totals) == set(CLASSES)
    assert 0.5 <= sampler.totals["rank"] <= 0.8, sampler.totals
    assert 0.25 <= sampler.totals["bench"] <= 0.5, sampler.totals   # counted once, not twice
    seconds, cpu, procs, machine = sampler.window(0, time.time() + 1)
    assert seconds > 0 and cpu["rank"] == sampler.totals["rank"] and machine > 0
    assert share_line(seconds, cpu, procs, machine).split(":")[1].lstrip().startswith(("rank", "bench", "other"))


def test_a_c_rank_counts_as_a_rank(tmp_path: Path) -> None:
    """The scale bench's C rank runs as its binary alone (argv == [path]): a rank too."""
    rank = tmp_path / "light_rank"
    sampler = Sampler(light_rank=str(rank), bench_pid=os.getpid(), interval_s=0.2)
    sampler.sample()
    # an interpreter titled as the binary (argv[0]), its program on stdin: /proc/PID/cmdline is [rank]
    proc = subprocess.Popen([str(rank)], executable=sys.executable, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(SPIN.format(s=0.6).encode())
    proc.stdin.close()
    time.sleep(0.3)
    sampler.sample()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    sampler.sample()
    proc.wait()
    assert 0.5 <= sampler.totals["rank"] <= 0.8, sampler.totals


def test_the_other_class_is_listed_by_name(tmp_path: Path) -> None:
    """What "other" holds is named: a process of no class by its command name, a kernel thread by its
    kind, init as init."""
    assert other_name(1, "process_api", 0) == "init"
    assert other_name(28011, "kworker/1:1H-kb", 2) == "kernel kworker"
    assert other_name(5000, "python3", 4000) == "python3"
    sampler = Sampler(light_rank=str(tmp_path / "light_rank"), bench_pid=-1, interval_s=0.2)
    sampler.sample()
    proc = subprocess.Popen([sys.executable, "-S", "-c", SPIN.format(s=0.5)])   # neither rank nor bench
    time.sleep(0.2)
    sampler.sample()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    sampler.sample()
    proc.wait()
    comm = Path(sys.executable).name[:15]
    others = sampler.others_window(0, time.time() + 1)
    assert others.get(comm, 0.0) >= 0.4, others
    assert comm in others_line(others)
