"""Make a node's ranks F times slower, and undo it: the fail-slow drill's fault.

Two ways, both on this host's pids only, both undone by ``stop`` (the drill calls it in a
``finally``, also on Ctrl-C or SIGTERM):

- a CPU quota (cgroup v1 ``cpu``, or v2 ``cpu.max``) where the cgroup tree is writable: each rank
  moves into its own cgroup ``omni-drill-<drill pid>-<rank pid>``. A rank computes in bursts and
  waits for its peers between them, so its average CPU use says little about the CPU it gets while
  it computes: the quota is the CPU it used over a short calibration divided by its busy fraction
  (its own time over its step time, from its heartbeat) and by F, over a 10 ms period (shorter than
  a burst, so the burst itself is slowed). ``stop`` moves it back where it was and removes the cgroup;
- otherwise a duty cycle of SIGSTOP and SIGCONT: every ``period_s`` (0.5 s) the ranks stop for
  ``(1 - 1/F)`` of it; ``stop`` always ends with SIGCONT. The stops stay far below a heartbeat's
  staleness window (1.5 s at least), so the ranks never look dead. Measured here (docs/failslow.md):
  with 0.1 s periods on cores that other processes keep busy, the scheduler gave a stopped task its
  share back when it continued (its sleeper credit), and the node did not slow at all; stops of
  a sixth of a second and more are not given back.

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


@dataclass
class SignalThrottle:
    """Duty-cycled SIGSTOP/SIGCONT of ``pids``: they run ``1/factor`` of every ``period_s``."""

    pids: list[int]
    factor: float
    period_s: float = 0.5
    method: str = "signals"
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="omni-throttle", daemon=True)
        self._thread.start()

    def _signal(self, sig: signal.Signals) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue   # the rank ended (the job finished or was migrated)

    def _run(self) -> None:
        stopped_s = self.period_s * (1.0 - 1.0 / self.factor)
        running_s = self.period_s - stopped_s
        while not self._stop.is_set():
            self._signal(signal.SIGSTOP)
            try:
                self._stop.wait(stopped_s)
            finally:
                self._signal(signal.SIGCONT)
            self._stop.wait(running_s)

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
