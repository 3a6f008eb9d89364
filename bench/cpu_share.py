"""Where the scale lane's CPU goes, per process class (issue 19): the light ranks, slurmstepd, slurmd,
slurmctld, munged, srun, the supervisor (with the Slurm commands it runs), the bench, and the rest
of the machine.

    python bench/cpu_share.py --conf .omni/cluster-scale/etc/slurm.conf --jobs 4001-4999 --out cpu.jsonl

A sampler reads every process's ``/proc/PID/stat`` each interval and adds each one's CPU (utime +
stime) since the sample before to its class. A process that ends between two samples leaves its
last part to the parent that reaps it (the parent's cutime + cstime grow by the child's whole
total): that remainder, less what was already counted of the children seen, goes to the parent's
class, so that a supervisor's squeue or scancel of 20 ms that no sample saw still counts as the
supervisor's (through parents gone too: a subshell's children). slurmstepd is daemonised (its parent
is init): what init reaped goes to the classes of the orphans it reaped since the sample before, in
proportion to their number, and a process seen exiting (no cmdline left) keeps the class it had. Both
went to "other" before: at 64 nodes 1.2 of its 3.0 CPU s in a crash's recovery (22:36). What stays
"other" is listed by name (:func:`other_name`). A sample of 3,000 processes costs about 40 ms of the
sampler's own CPU (the bench's class when the bench runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

CLASSES = ("rank", "slurmstepd", "slurmd", "slurmctld", "munged", "srun", "supervisor", "bench", "other")
CLK_TCK = os.sysconf("SC_CLK_TCK")


class Sampler:
    """Cumulative CPU seconds per class (``totals``) and processes per class (``counts``), sampled
    every ``interval_s`` by a thread (``start``/``stop``) or by ``sample()`` calls."""

    def __init__(self, *, conf: str = "", jobs: tuple[int, int] | set[str] | None = None, light_rank: str = "",
                 bench_pid: int = 0, interval_s: float = 1.0) -> None:
        self.conf, self.jobs, self.light_rank = conf, jobs, light_rank
        self.bench_pid = bench_pid
        self.interval_s = interval_s
        self.totals = dict.fromkeys(CLASSES, 0.0)
        self.counts = dict.fromkeys(CLASSES, 0)
        self.others: dict[str, float] = {}
        """The other class's CPU seconds by what the process is (:func:`other_name`): what "other" holds."""
        self.series: list[tuple[float, dict[str, float], dict[str, int], float, dict[str, float]]] = []
        """(time.time(), totals, counts, the machine's busy CPU seconds from /proc/stat, others) after
        each sample."""
        self.own_s = 0.0
        """The sampler's own CPU (thread time) so far."""
        self._seen: dict[int, tuple[int, str, str, int, int, int]] = {}
        """pid -> (starttime, comm, class, u+s, cu+cs, ppid) at the last sample."""
        self._first = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    ASKED_AGAIN = ("bench", "supervisor", "other")
    """Classes a process may have from its parent (or from no match): read again every sample, as is
    every slurmstepd (it titles itself "slurmstepd: [JOB.STEP]" after its start; before, at 256 nodes
    under load, a third of the stepd's CPU was counted as other)."""

    # -- classes ------------------------------------------------------------------------------
    def classify(self, pid: int, ppid_class: str) -> str:
        try:
            argv = [c.decode(errors="replace") for c in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if c]
        except OSError:
            return "other"
        if pid == self.bench_pid or any(a.endswith("scale_bench.py") for a in argv[:3]):
            return "bench"
        if not argv:
            return ppid_class if ppid_class in ("supervisor", "bench") else "other"
        name = os.path.basename(argv[0])
        if argv[0].startswith("slurmstepd"):
            return "slurmstepd" if self._our_step(argv[0]) else "other"
        if name == "slurmstepd":   # not titled "slurmstepd: [JOB.STEP]" yet: asked again next sample
            return "slurmstepd"
        if name in ("slurmd", "slurmctld", "munged"):
            mine = not self.conf or any(self.conf in a for a in argv) or \
                (name == "munged" and any(os.path.dirname(os.path.dirname(self.conf)) in a for a in argv))
            return name if mine else "other"
        if name == "srun":
            return "srun" if ppid_class == "supervisor" else ppid_class if ppid_class == "bench" else "other"
        if "supervise" in argv and any(a.startswith("--stages=") for a in argv):
            return "supervisor"
        if self.light_rank and (argv[1:] == ["-S", self.light_rank] or argv == [self.light_rank]):   # python, C
            return "rank"
        if ppid_class in ("supervisor", "bench", "srun"):
            return "supervisor" if ppid_class == "srun" else ppid_class
        if ppid_class == "slurmstepd" and name in ("bash", "sh"):
            return "rank"   # a task's wrapper before it execs the rank
        return "other"

    def _our_step(self, title: str) -> bool:
        # "slurmstepd: [4012.0]", "slurmstepd: [4012.batch]"
        job = title.partition("[")[2].split(".")[0].rstrip("]")
        if self.jobs is None:
            return True
        if isinstance(self.jobs, tuple):
            return job.isdigit() and self.jobs[0] <= int(job) <= self.jobs[1]
        return job in self.jobs

    # -- sampling -----------------------------------------------------------------------------
    def sample(self) -> None:
        c0 = time.thread_time()
        now: dict[int, tuple[int, str, str, int, int, int]] = {}
        stats = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    raw = f.read()
            except OSError:
                continue
            head, _, rest = raw.rpartition(b")")
            comm = head.partition(b"(")[2].decode(errors="replace")
            fields = rest.split()
            try:
                ppid = int(fields[1])
                us, cs = int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])
                start = int(fields[19])
            except (IndexError, ValueError):
                continue
            stats[int(entry.name)] = (start, comm, us, cs, ppid)
        # parents before children where both are new: classify in pid order, ppid's class when known
        with self._lock:
            gained = dict.fromkeys(CLASSES, 0)
            # what of the processes gone since the last sample was counted already: the live ancestor
            # that reaped them (through gone parents: a subshell's children) has it in its cutime
            gone = {pid for pid, old in self._seen.items() if pid not in stats or stats[pid][0] != old[0]}
            reaped_by: dict[int, int] = {}
            orphans: dict[str, int] = {}   # the classes of the gone processes init reaped, how many each
            for pid in gone:
                old = self._seen[pid]
                reaper = old[5]
                while reaper in gone:
                    reaper = self._seen[reaper][5]
                reaped_by[reaper] = reaped_by.get(reaper, 0) + old[3] + old[4]
                if reaper == 1:
                    orphans[old[2]] = orphans.get(old[2], 0) + 1
            for pid in sorted(stats):
                start, comm, us, cs, ppid = stats[pid]
                old = self._seen.get(pid)
                # a class of one's own is kept; one inherited (or other) is asked again: an exec that
                # kept the name (python -> python) changes what the process is
                if old is not None and old[0] == start and old[1] == comm and old[2] not in self.ASKED_AGAIN \
                        and comm != "slurmstepd":
                    cls = old[2]
                else:
                    parent = now.get(ppid) or self._seen.get(ppid)
                    cls = self.classify(pid, parent[2] if parent else "other")
                    if cls == "other" and old is not None and old[0] == start and old[1] == comm \
                            and not _has_cmdline(pid):
                        cls = old[2]   # exiting or a zombie (no cmdline left): what it was, not other
                now[pid] = (start, comm, cls, us, cs, ppid)
                gained[cls] += 1
                if self._first:
                    continue
                if old is not None and old[0] == start:
                    d_self, d_children = us - old[3], cs - old[4]
                else:
                    d_self, d_children = us, cs
                d_children -= reaped_by.get(pid, 0)   # the part of the reaped children counted already
                if pid == 1 and d_children > 0 and orphans:
                    # init reaps the daemonised (slurmstepd) and orphaned: their last part is theirs,
                    # split among the classes of the orphans it reaped since the sample before
                    n = sum(orphans.values())
                    for c, k in orphans.items():
                        self.totals[c] += d_children * k / n / CLK_TCK
                    d_children = 0
                self.totals[cls] += (max(0, d_self) + max(0, d_children)) / CLK_TCK
                if cls == "other":
                    for name, ticks in ((other_name(pid, comm, ppid), d_self), (other_name(pid, comm, ppid) +
                                                                                " (reaped children)", d_children)):
                        if ticks > 0:
                            self.others[name] = self.others.get(name, 0.0) + ticks / CLK_TCK
            self.counts = gained
            self._seen = now
            self._first = False
            self.own_s += time.thread_time() - c0
            self.series.append((time.time(), dict(self.totals), dict(self.counts), machine_busy_s(),
                                dict(self.others)))

    def start(self) -> Sampler:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="cpu-share", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def window(self, t0: float, t1: float) -> tuple[float, dict[str, float], dict[str, float], float]:
        """(seconds, CPU seconds per class, mean processes per class, the machine's busy CPU seconds)
        between the samples nearest ``t0`` and ``t1`` (wall clock)."""
        with self._lock:
            series = list(self.series)
        if len(series) < 2:
            return 0.0, {}, {}, 0.0
        a, b = _nearest(series, t0), _nearest(series, t1)
        inside = [s for s in series if a[0] <= s[0] <= b[0]] or [b]
        cpu = {c: b[1].get(c, 0.0) - a[1].get(c, 0.0) for c in CLASSES}
        procs = {c: sum(s[2].get(c, 0) for s in inside) / len(inside) for c in CLASSES}
        return b[0] - a[0], cpu, procs, b[3] - a[3]

    def others_window(self, t0: float, t1: float, top: int = 6) -> dict[str, float]:
        """The other class's CPU seconds by name between the samples nearest ``t0`` and ``t1``, the
        ``top`` largest (the rest summed as "rest")."""
        with self._lock:
            series = list(self.series)
        if len(series) < 2:
            return {}
        a, b = _nearest(series, t0), _nearest(series, t1)
        used = sorted(((v - a[4].get(k, 0.0), k) for k, v in b[4].items()), reverse=True)
        out = {k: v for v, k in used[:top] if v > 0}
        rest = sum(v for v, _ in used[top:] if v > 0)
        return out | ({"rest": rest} if rest > 0 else {})


def _nearest(series: list[tuple[float, dict[str, float], dict[str, int], float, dict[str, float]]],
             t: float) -> tuple[float, dict[str, float], dict[str, int], float, dict[str, float]]:
    return min(series, key=lambda s: abs(s[0] - t))


def _has_cmdline(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return bool(f.read(1))
    except OSError:
        return False


def other_name(pid: int, comm: str, ppid: int) -> str:
    """What a process of the other class is, by name: a kernel thread by its kind ("kernel kworker",
    "kernel ksoftirqd"), the machine's init ("init"), else its command name (another cluster's
    slurmstepd, a peer's python)."""
    if pid == 1:
        return "init"
    if ppid == 2 or pid == 2:
        return "kernel " + comm.split("/")[0]
    return comm


def machine_busy_s() -> float:
    """CPU seconds the machine was busy since boot, every core (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / CLK_TCK


def others_line(others: dict[str, float]) -> str:
    """``kernel kswapd0 1.20 s, init (reaped children) 0.80 s, ...``: what the other class holds."""
    return ", ".join(f"{k} {v:.2f} s" for k, v in sorted(others.items(), key=lambda kv: -kv[1]))


def share_line(seconds: float, cpu: dict[str, float], procs: dict[str, float], machine_s: float = 0.0,
               cores: int | None = None) -> str:
    """``rank 61% (1.2 s, 2044 x 0.3 ms/s), slurmctld 4% ...``: each class's share of the CPU used, its
    seconds, and per process its ms of CPU per second; with the machine's busy seconds beside the
    sum (what the sampler missed: interrupts, processes too short for any sample whose parent is
    gone)."""
    cores = cores or os.cpu_count() or 1
    used = sum(cpu.values())
    if seconds <= 0 or used <= 0:
        return "n/a"
    parts = []
    for c in sorted(CLASSES, key=lambda c: -cpu.get(c, 0.0)):
        v = cpu.get(c, 0.0)
        if v < 0.005 and not procs.get(c):
            continue
        n = procs.get(c, 0.0)
        each = f", {n:.0f} x {1000 * v / n / seconds:.2f} ms/s" if n >= 2 else ""
        parts.append(f"{c} {100 * v / used:.0f}% ({v:.2f} s{each})")
    busy = f", the machine busy {machine_s:.1f} s" if machine_s else ""
    return (f"{used:.1f} CPU s in {seconds:.1f} s ({100 * used / seconds / cores:.0f}% of {cores} cores{busy}): "
            + ", ".join(parts))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conf", default="", help="The cluster's slurm.conf (its daemons; others count as other).")
    p.add_argument("--jobs", default="", help="Job ids of its slurmstepd: FIRST-LAST (default: any).")
    p.add_argument("--light-rank", default=str(Path(__file__).resolve().parent / "light_rank.py"))
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--out", required=True, help="JSON lines: time, CPU seconds per class so far, processes per class.")
    args = p.parse_args()
    jobs = tuple(int(x) for x in args.jobs.split("-")) if args.jobs else None
    s = Sampler(conf=args.conf, jobs=jobs if jobs and len(jobs) == 2 else None,  # type: ignore[arg-type]
                light_rank=args.light_rank, interval_s=args.interval, bench_pid=-1)
    with open(args.out, "a") as out:
        try:
            while True:
                s.sample()
                t, totals, counts, busy, others = s.series[-1]
                out.write(json.dumps({"t": t, "cpu": totals, "n": counts, "busy": busy, "own": s.own_s,
                                      "others": others}) + "\n")
                out.flush()
                s.series.clear()
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(main())
