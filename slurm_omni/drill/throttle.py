"""Make a node's ranks F times slower, and undo it: the fail-slow drill's fault.

Two ways, both on this host's pids only, both undone by ``stop`` (the drill calls it in a
``finally``, also on Ctrl-C or SIGTERM):

- a CPU quota (cgroup v1 ``cpu``, or v2 ``cpu.max``) where the cgroup tree is writable: each rank
  moves into its own cgroup ``omni-drill-<drill pid>-<rank pid>``. A rank computes in bursts and
  waits for its peers between them, so its average CPU use says little about the CPU it gets while
  it computes: the quota is the CPU it used over a short calibration divided by its busy fraction
  (its own time over its step time, from its heartbeat) and by F, over a 10 ms period (shorter than
  a burst, so the burst itself is slowed). ``stop`` moves it back where it was and removes the cgroup;
- otherwise SIGSTOP and SIGCONT in proportion to the CPU each rank uses (``SignalThrottle``): its
  own work takes F times the wall time, its waits for peers are untouched; ``stop`` always ends
  with SIGCONT. A stop lasts at most 0.3 s, far below a heartbeat's staleness window (1.5 s at
  least), so the ranks never look dead. Measured here (docs/failslow.md): fixed duty cycles were
  no good on shared cores: with 0.1 s periods the scheduler gave a stopped task its share back
  (sleeper credit), with 0.5 s periods the stops landed in the ranks' waits.

Only processes of the user running the drill are touched: a pid owned by anybody else is refused.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from slurm_omni.drill.inject import DrillError, DrillRefused

log = logging.getLogger(__name__)

Method = Literal["auto", "cgroup", "signals"]
METHODS = ("auto", "cgroup", "signals")
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
PERIOD_US = 10_000


class Throttle(Protocol):
    method: str

    def start(self) -> None: ...

    def stop(self) -> None: ...


def check_owned(pids: list[int], uid: int | None = None) -> list[int]:
    """``pids`` when every one is alive and its real uid is ``uid`` (default: ours), else refused."""
    uid = os.getuid() if uid is None else uid
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError as e:
            raise DrillError(f"drill: couldn't read /proc/{pid}/status: {e.strerror} (the rank exited?)") from e
        owner = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:")), -1)
        if owner != uid:
            raise DrillRefused(f"drill: couldn't throttle pid {pid}: it belongs to uid {owner}, not {uid} "
                               "(only the job owner's processes are touched)")
    return pids


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


MAX_STOP_S = 0.3    # one stop stays far below a heartbeat's staleness window (1.5 s at least)
MIN_STOP_S = 0.005


def is_running(pid: int) -> bool:
    """True when the process's main thread is running or runnable (state R): it is doing its own
    work, not waiting for a peer (a receive or a collective sleeps, state S)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
    except (OSError, IndexError):
        return False


def cpu_seconds_of(pid: int) -> float | None:
    """CPU time of all of ``pid``'s threads (``/proc/PID/task/*/schedstat``, nanoseconds); None once gone."""
    total = 0
    try:
        tasks = list(os.scandir(f"/proc/{pid}/task"))
    except OSError:
        return None
    for task in tasks:
        try:
            total += int(Path(task.path, "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


@dataclass
class SignalThrottle:
    """SIGSTOP/SIGCONT of ``pids`` in proportion to the CPU they use: every ``tick_s`` each rank owes
    ``(factor - 1)`` times the CPU time it used since, and is stopped that long, but only while its
    main thread is running (state R: inside its own work). Its own work then takes ``factor`` times
    the wall time, as on a slower device, while its waits for its peers (no CPU, state S) are left
    alone: the debt waits for the next burst of work. Stops that land in the waits (a fixed duty
    cycle, or stopping whenever a debt is due) slow the whole job and leave the rank's own time
    nearly as it was (measured, docs/failslow.md)."""

    pids: list[int]
    factor: float
    tick_s: float = 0.01
    method: str = "signals"
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="omni-throttle", daemon=True)
        self._thread.start()

    def _signal(self, sig: signal.Signals, pids: list[int] | None = None) -> None:
        for pid in self.pids if pids is None else pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue   # the rank ended (the job finished or was migrated)

    def _run(self) -> None:
        last = {pid: cpu_seconds_of(pid) for pid in self.pids}
        debt = dict.fromkeys(self.pids, 0.0)
        while not self._stop.wait(self.tick_s):
            for pid in self.pids:
                now, before = cpu_seconds_of(pid), last[pid]
                if now is not None and before is not None:
                    debt[pid] += max(0.0, now - before) * (self.factor - 1.0)
                last[pid] = now
            owed = sorted((min(d, MAX_STOP_S), pid) for pid, d in debt.items()
                          if d >= MIN_STOP_S and is_running(pid))
            if not owed:
                continue
            t0 = time.monotonic()
            self._signal(signal.SIGSTOP, [pid for _, pid in owed])
            try:
                for d, pid in owed:
                    self._stop.wait(max(0.0, t0 + d - time.monotonic()))
                    self._signal(signal.SIGCONT, [pid])
                    debt[pid] -= d
            finally:
                self._signal(signal.SIGCONT, [pid for _, pid in owed])
            for pid in self.pids:   # the stop itself used no CPU; start counting afresh
                last[pid] = cpu_seconds_of(pid)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._signal(signal.SIGCONT)


def cgroup_root() -> tuple[Path, int] | None:
    """(where to make cgroups, cgroup version) when this process may create them, else None."""
    for root, version in ((CGROUP_V1_CPU, 1), (CGROUP_V2, 2)):
        probe = root / f"omni-drill-probe-{os.getpid()}"
        if version == 2 and "cpu" not in _read(root / "cgroup.controllers").split():
            continue
        if not (root / "cgroup.procs").exists():
            continue
        try:
            probe.mkdir()
        except OSError:
            continue
        probe.rmdir()
        return root, version
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def cgroup_of(pid: int, version: int) -> str:
    """The pid's cgroup path in the hierarchy we write to (``/`` when none is named)."""
    for line in _read(Path(f"/proc/{pid}/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        if (version == 1 and "cpu" in controllers.split(",")) or (version == 2 and controllers == ""):
            return path
    return "/"


@dataclass
class CgroupQuota:
    """Each of ``pids`` in its own cgroup with a CPU quota of its measured use divided by ``factor``."""

    pids: list[int]
    factor: float
    root: Path
    version: int
    busy: dict[int, float] = field(default_factory=dict)   # pid -> fraction of wall time it computes
    calibrate_s: float = 2.0
    method: str = "cgroup"
    quotas: dict[int, float] = field(default_factory=dict)   # pid -> CPUs allowed
    _made: dict[int, tuple[Path, Path]] = field(default_factory=dict)   # pid -> (its cgroup, where it was)

    def start(self) -> None:
        before = {pid: _cpu_seconds(pid) for pid in self.pids}
        t0 = time.monotonic()
        time.sleep(self.calibrate_s)
        elapsed = time.monotonic() - t0
        try:
            for pid in self.pids:
                used = max(0.01, (_cpu_seconds(pid) - before[pid]) / elapsed)
                busy = min(1.0, max(0.05, self.busy.get(pid, 1.0)))
                self.quotas[pid] = min(1.0, used / busy) / self.factor
                self._move(pid, max(1000, int(self.quotas[pid] * PERIOD_US)))
        except BaseException:
            self.stop()
            raise
        log.info("drill: cgroup quotas (CPUs) %s", {p: round(q, 3) for p, q in self.quotas.items()})

    def _move(self, pid: int, quota_us: int) -> None:
        origin = self.root / cgroup_of(pid, self.version).lstrip("/")
        cg = self.root / f"omni-drill-{os.getpid()}-{pid}"
        try:
            cg.mkdir(mode=0o755)    # fails if it exists: never reuse a cgroup somebody else made
            st = os.lstat(cg)
            if st.st_uid != os.geteuid():
                raise DrillError(f"drill: couldn't trust {cg}: owned by uid {st.st_uid}")
            self._made[pid] = (cg, origin)
            if self.version == 1:
                (cg / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (cg / "cpu.cfs_quota_us").write_text(str(quota_us))
            else:
                (cg / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
            (cg / "cgroup.procs").write_text(str(pid))
        except OSError as e:
            raise DrillError(f"drill: couldn't put pid {pid} under a CPU quota in {cg}: {e.strerror}") from e

    def stop(self) -> None:
        for pid, (cg, origin) in list(self._made.items()):
            try:
                (origin / "cgroup.procs").write_text(str(pid))
            except OSError as e:
                if e.errno != 3:   # ESRCH: the rank ended
                    log.warning("drill: couldn't move pid %d back to %s: %s", pid, origin, e.strerror)
            try:
                cg.rmdir()
            except OSError as e:
                log.warning("drill: couldn't remove %s: %s", cg, e.strerror)
            del self._made[pid]


def throttle(pids: list[int], factor: float, method: Method = "auto", *,
             busy: dict[int, float] | None = None) -> Throttle:
    """A throttle of ``pids`` (checked to be ours) by ``factor`` (> 1), not started yet; ``busy``:
    each pid's fraction of wall time spent on its own work (for the quota)."""
    if not factor > 1.0:
        raise DrillError(f"drill: factor {factor} is not allowed (expected > 1: how many times slower)")
    if method not in METHODS:
        raise DrillError(f"drill: method {method!r} is not allowed (expected one of {', '.join(METHODS)})")
    check_owned(pids)
    if method in ("auto", "cgroup"):
        found = cgroup_root()
        if found is not None:
            return CgroupQuota(pids, factor, found[0], found[1], busy=dict(busy or {}))
        if method == "cgroup":
            raise DrillError("drill: couldn't make a cgroup with a CPU quota here (read-only or no cpu "
                             "controller); use --method signals")
    return SignalThrottle(pids, factor)
