"""Start, inspect and stop the embedded cluster's daemons.

Only processes recorded in the state directory's pid files are ever signalled, and only after their
command line is checked, so a system Slurm on the same machine is never touched.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from slurm_omni.cluster.spec import (
    ClusterPaths,
    ClusterSpec,
    render_gres_conf,
    render_plugstack_conf,
    render_slurm_conf,
    render_topology_conf,
)
from slurm_omni.errors import ClusterError, OmniError
from slurm_omni.slurm.types import Node, NodeState

log = logging.getLogger(__name__)

REQUIRED_COMMANDS = {
    "munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "sinfo": "slurm-client",
    "scontrol": "slurm-client", "sbatch": "slurm-client",
}
SYSTEM_SLURM_CONF = Path("/etc/slurm/slurm.conf")
DEFAULT_PLUGIN = Path(__file__).resolve().parents[2] / "spank" / "omni_spank.so"


@dataclass(frozen=True, slots=True)
class Daemon:
    name: str           # "munged", "slurmctld", "slurmd:node3"
    argv: tuple[str, ...]
    pid_file: Path
    log_file: Path


def check_packages() -> None:
    missing = sorted({pkg for cmd, pkg in REQUIRED_COMMANDS.items() if shutil.which(cmd) is None
                      and not Path("/usr/sbin", cmd).exists()})
    if missing:
        raise ClusterError("cluster: couldn't find the Slurm packages: " + " ".join(missing)
                           + f" (install them: apt-get install -y {' '.join(missing)} libslurm-dev, "
                           "or run scripts/setup.sh)")


def _sbin(cmd: str) -> str:
    return shutil.which(cmd) or str(Path("/usr/sbin", cmd))


class LocalCluster:
    def __init__(self, state_dir: Path, spec: ClusterSpec | None = None, plugin: Path | None = None) -> None:
        self.paths = ClusterPaths(state_dir.resolve())
        self._spec = spec
        self.plugin = (plugin or DEFAULT_PLUGIN).resolve()

    # -- what it is -------------------------------------------------------------------------------
    @property
    def spec(self) -> ClusterSpec:
        if self._spec is None:
            self._spec = self.recorded_spec() or ClusterSpec()
        return self._spec

    def recorded_spec(self) -> ClusterSpec | None:
        try:
            data = json.loads(self.paths.record.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise ClusterError(f"cluster: couldn't read {self.paths.record}: {e} (remove the state dir)") from e
        spec = data["spec"]
        spec["partitions"] = tuple(spec["partitions"])
        return ClusterSpec(**spec)

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.paths.slurm_conf)}

    def daemons(self) -> list[Daemon]:
        p, conf = self.paths, str(self.paths.slurm_conf)
        out = [
            Daemon("munged", (_sbin("munged"), "--foreground", "--force", f"--socket={p.munge_socket}",
                              f"--key-file={p.munge_key}", f"--pid-file={p.munge_dir / 'munged.pid'}",
                              f"--log-file={p.munge_dir / 'munged.log'}",
                              f"--seed-file={p.munge_dir / 'munged.seed'}"),
                   p.munge_dir / "omni.pid", p.munge_dir / "munged.out"),
            Daemon("slurmctld", (_sbin("slurmctld"), "-D", "-f", conf),
                   p.ctld_dir / "omni.pid", p.ctld_dir / "slurmctld.out"),
        ]
        for node in self.spec.node_names:
            d = p.node_dir(node)
            out.append(Daemon(f"slurmd:{node}", (_sbin("slurmd"), "-D", "-N", node, "-f", conf),
                              d / "omni.pid", d / "slurmd.out"))
        return out

    def running(self) -> dict[str, int | None]:
        """Each daemon's pid if it is alive and is the program we started, else None."""
        return {d.name: _live_pid(d) for d in self.daemons()}

    # -- up -----------------------------------------------------------------------------------------
    def up(self, wait_s: float = 90.0) -> bool:
        """Bring the cluster up; returns False when everything was already running (a no-op)."""
        check_packages()
        recorded = self.recorded_spec()
        alive = self.running()
        if recorded is not None and self._spec is not None and recorded != self._spec and any(alive.values()):
            raise ClusterError(f"cluster: couldn't reshape the running cluster in {self.paths.root} "
                               "(run 'omni cluster down' first)")
        if alive and all(alive.values()) and self.paths.slurm_conf.exists():
            log.info("cluster already up in %s", self.paths.root)
            self._write_plugstack()
            return False
        fresh = not any(alive.values())
        self._write_files()
        restarted = []
        for daemon in self.daemons():
            if alive.get(daemon.name) is None:
                # A fresh cluster starts clean (-c: no jobs or node states from an earlier run); a
                # slurmctld restarted under live slurmds keeps its state.
                self._start(daemon, extra=("-c",) if fresh and daemon.name == "slurmctld" else ())
                restarted.append(daemon.name.removeprefix("slurmd:"))
                if daemon.name == "munged":
                    self._wait_for(lambda: self.paths.munge_socket.exists(), 10, "munged's socket")
        self._link_system_conf()
        if fresh:
            self.wait_idle(wait_s)
        else:
            self.wait_responding(set(restarted) & set(self.spec.node_names), wait_s)
        return True

    def _write_files(self) -> None:
        p, spec = self.paths, self.spec
        for d in (p.root, p.etc, p.munge_dir, p.ctld_dir, p.ctld_dir / "state", p.dev):
            d.mkdir(parents=True, exist_ok=True)
        p.munge_dir.chmod(0o700)
        p.spool.mkdir(mode=0o700, parents=True, exist_ok=True)
        p.spool.chmod(0o700)
        if not p.munge_key.exists():
            _write_private(p.munge_key, secrets.token_bytes(1024))
        for node in spec.node_names:
            (p.node_dir(node) / "spool").mkdir(parents=True, exist_ok=True)
            for gpu in p.gpu_files(node, spec.gpus_per_node):
                gpu.parent.mkdir(parents=True, exist_ok=True)
                if not gpu.exists():
                    # The same major/minor as /dev/null: a character device slurmd accepts as a GPU.
                    os.mknod(gpu, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        _write_text(p.etc / "slurm.conf", render_slurm_conf(spec, p))
        _write_text(p.etc / "topology.conf", render_topology_conf(spec))
        _write_text(p.etc / "gres.conf", render_gres_conf(spec, p))
        self._write_plugstack()
        _write_text(p.record, json.dumps({"spec": asdict(spec), "plugin": str(self.plugin)}, indent=2))

    def _write_plugstack(self) -> None:
        plugin = self.plugin if self.plugin.exists() else None
        _write_text(self.paths.etc / "plugstack.conf", render_plugstack_conf(plugin, self.paths))

    def _start(self, daemon: Daemon, extra: tuple[str, ...] = ()) -> None:
        daemon.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(daemon.log_file, "ab") as out:
            proc = subprocess.Popen([*daemon.argv, *extra], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **self.env})
        _write_text(daemon.pid_file, f"{proc.pid}\n")
        time.sleep(0.05)
        if proc.poll() is not None:
            raise ClusterError(f"cluster: couldn't start {daemon.name}: exited {proc.returncode} "
                               f"(see {daemon.log_file})")
        log.info("started %s (pid %d)", daemon.name, proc.pid)

    def _link_system_conf(self) -> None:
        # Plain `sinfo` reads /etc/slurm/slurm.conf; point it at us only where no system Slurm is configured.
        try:
            if SYSTEM_SLURM_CONF.is_symlink() and _ours(SYSTEM_SLURM_CONF):
                SYSTEM_SLURM_CONF.unlink()   # left by another checkout's cluster
            if not SYSTEM_SLURM_CONF.exists() and not SYSTEM_SLURM_CONF.is_symlink():
                SYSTEM_SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
                SYSTEM_SLURM_CONF.symlink_to(self.paths.slurm_conf)
        except OSError as e:
            log.info("not linking %s: %s (use SLURM_CONF=%s)", SYSTEM_SLURM_CONF, e, self.paths.slurm_conf)

    def _unlink_system_conf(self) -> None:
        if SYSTEM_SLURM_CONF.is_symlink() and Path(os.readlink(SYSTEM_SLURM_CONF)) == self.paths.slurm_conf:
            SYSTEM_SLURM_CONF.unlink()

    def wait_idle(self, wait_s: float) -> None:
        """Until every node is IDLE (a fresh cluster)."""
        self._wait_nodes(set(self.spec.node_names), lambda n: n.state is NodeState.IDLE, "idle", wait_s)

    def wait_responding(self, names: set[str], wait_s: float) -> None:
        """Until the named nodes answer slurmctld again (a restarted slurmd)."""
        self._wait_nodes(names, lambda n: "NOT_RESPONDING" not in n.flags
                         and n.state is not NodeState.UNKNOWN, "responding", wait_s)

    def _wait_nodes(self, names: set[str], ready: Callable[[Node], bool], what: str, wait_s: float) -> None:
        from slurm_omni.slurm.cli_backend import CliBackend

        backend = CliBackend(env=self.env, timeout_s=5, retries=0)
        deadline = time.monotonic() + wait_s
        last = "no answer from slurmctld"
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                nodes = {n.name: n for n in backend.nodes()}
                waiting = sorted(f"{name}={nodes[name].slurm_state}" if name in nodes else f"{name}=missing"
                                 for name in names if name not in nodes or not ready(nodes[name]))
                if not waiting:
                    return
                last = f"not {what} yet: " + ", ".join(waiting[:4])
            except OmniError as e:  # slurmctld is still starting
                last = str(e)
            time.sleep(0.3)
        raise ClusterError(f"cluster: couldn't get nodes {what} within {wait_s:.0f}s: {last} "
                           f"(logs under {self.paths.root})")

    def _check_alive(self) -> None:
        dead = [name for name, pid in self.running().items() if pid is None]
        if dead:
            d = next(x for x in self.daemons() if x.name == dead[0])
            tail = _tail(d.log_file)
            raise ClusterError(f"cluster: {d.name} exited: {tail} (see {d.log_file})")

    @staticmethod
    def _wait_for(cond: Callable[[], bool], wait_s: float, what: str) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.05)
        raise ClusterError(f"cluster: couldn't see {what} within {wait_s:.0f}s")

    # -- down ---------------------------------------------------------------------------------------
    def down(self, wait_s: float = 20.0) -> list[str]:
        """Stop what we started (jobs, slurmd, slurmctld, munged last); returns the names stopped."""
        self._cancel_jobs()
        stopped: list[str] = []
        for daemon in reversed(self.daemons()):
            pid = _live_pid(daemon)
            if pid is None:
                daemon.pid_file.unlink(missing_ok=True)
                continue
            _signal_group(pid, signal.SIGTERM)
            stopped.append(daemon.name)
        deadline = time.monotonic() + wait_s
        for daemon in reversed(self.daemons()):
            pid = _live_pid(daemon)
            while pid is not None and time.monotonic() < deadline:
                time.sleep(0.1)
                pid = _live_pid(daemon)
            if pid is not None:
                log.warning("%s (pid %d) ignored SIGTERM; killing", daemon.name, pid)
                _signal_group(pid, signal.SIGKILL)
            daemon.pid_file.unlink(missing_ok=True)
        stopped += self._kill_strays()
        self._unlink_system_conf()
        return stopped

    def _cancel_jobs(self) -> None:
        if self.running().get("slurmctld") is None:
            return
        from slurm_omni.slurm.cli_backend import CliBackend

        backend = CliBackend(env=self.env, timeout_s=5, retries=0)
        try:
            for job in backend.jobs():
                if not job.state.finished:
                    backend.cancel(str(job.job_id))
        except OmniError as e:
            log.warning("couldn't cancel the cluster's jobs before stopping: %s", e)

    def _kill_strays(self) -> list[str]:
        """slurmstepd and job processes run in sessions of their own; find ours by their open files."""
        root = str(self.paths.root)
        killed = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if not (proc / "cmdline").read_bytes().startswith(b"slurmstepd"):
                    continue
                paths = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
            except OSError:
                continue
            if any(p.startswith(root) for p in paths):
                _signal_group(int(proc.name), signal.SIGKILL)
                killed.append(f"slurmstepd:{proc.name}")
        return killed

    def kill_daemon(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Signal one daemon we started (drills and tests); returns its pid."""
        daemon = next((d for d in self.daemons() if d.name == name), None)
        pid = _live_pid(daemon) if daemon else None
        if pid is None:
            raise ClusterError(f"cluster: couldn't signal {name}: not running (daemons: "
                               f"{', '.join(d.name for d in self.daemons())})")
        os.kill(pid, sig)
        return pid


def _ours(link: Path) -> bool:
    """A link to a slurm.conf that slurm-omni generated (or to nothing at all)."""
    try:
        return link.read_text().startswith("# Generated by slurm-omni")
    except OSError:
        return True


def _live_pid(daemon: Daemon | None) -> int | None:
    if daemon is None:
        return None
    try:
        pid = int(daemon.pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat_fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return None
    if stat_fields and stat_fields[0] == "Z":
        return None
    # Guard against pid reuse: the process must still be the program and arguments we started.
    if [c.decode(errors="replace") for c in cmdline if c][:len(daemon.argv)] != list(daemon.argv):
        return None
    return pid


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # started with start_new_session: the daemon leads its own group
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(pid, sig)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _tail(path: Path, lines: int = 1) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:]) if text else "no output"
