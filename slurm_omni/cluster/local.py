"""Start, inspect and stop the embedded cluster's daemons.

Only processes recorded in the state directory's pid files are ever signalled, and only after their
command line is checked, so a system Slurm on the same machine is never touched.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from slurm_omni.cluster.chroot import (
    CLIENTS,
    DebianRoot,
    RootView,
    job_binds,
    render_client_wrapper,
    view_path,
)
from slurm_omni.cluster.spec import (
    ClusterPaths,
    ClusterSpec,
    munged_threads,
    node_munged,
    render_cgroup_conf,
    render_gres_conf,
    render_plugstack_conf,
    render_slurm_conf,
    render_topology_conf,
)
from slurm_omni.cluster.versions import VERSIONS
from slurm_omni.errors import ClusterError, OmniError
from slurm_omni.fsio import write_atomic
from slurm_omni.slurm.types import Node, NodeState

log = logging.getLogger(__name__)

REQUIRED_COMMANDS = {
    "munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "sinfo": "slurm-client",
    "scontrol": "slurm-client", "sbatch": "slurm-client",
}
SYSTEM_SLURM_CONF = Path("/etc/slurm/slurm.conf")
PROJECT = Path(__file__).resolve().parents[2]
DEFAULT_PLUGIN = PROJECT / "spank" / "omni_spank.so"
START_BATCH = 32
"""slurmd started together, then checked, before the next batch."""
WAIT_PER_NODE_S = 0.5
"""More time for the nodes to become idle, per node (512 slurmd register on two shared cores)."""
NODE_MUNGED = "munged:nodes"
"""The nodes' own munged on a large cluster (``spec.node_munged``)."""


@dataclass(frozen=True, slots=True)
class Daemon:
    name: str           # "munged", "munged:nodes", "slurmctld", "slurmd:node3"
    argv: tuple[str, ...]
    pid_file: Path
    log_file: Path
    root: Path | None = None   # runs chrooted there (argv is then the path inside)


def check_packages(spec: ClusterSpec | None = None) -> None:
    if spec is not None and spec.in_root:
        missing = sorted({pkg for cmd, pkg in (("chroot", "coreutils"), ("mount", "mount"),
                                               ("debootstrap", "debootstrap"))
                          if shutil.which(cmd) is None and not Path("/usr/sbin", cmd).exists()})
        if missing:
            raise ClusterError(f"cluster: couldn't run Slurm {spec.slurm_version} from a Debian root: "
                               f"missing {' '.join(missing)} (apt-get install -y {' '.join(missing)}, "
                               "or scripts/setup.sh)")
        if os.geteuid() != 0:
            raise ClusterError(f"cluster: couldn't run Slurm {spec.slurm_version} from a Debian root: "
                               "chroot and mount need root")
        return
    missing = sorted({pkg for cmd, pkg in REQUIRED_COMMANDS.items() if shutil.which(cmd) is None
                      and not Path("/usr/sbin", cmd).exists()})
    if missing:
        raise ClusterError("cluster: couldn't find the Slurm packages: " + " ".join(missing)
                           + f" (install them: apt-get install -y {' '.join(missing)} libslurm-dev, "
                           "or run scripts/setup.sh)")


def _host_sbin(cmd: str) -> str:
    return shutil.which(cmd) or str(Path("/usr/sbin", cmd))


class LocalCluster:
    def __init__(self, state_dir: Path, spec: ClusterSpec | None = None, plugin: Path | None = None) -> None:
        self.paths = ClusterPaths(state_dir.resolve())
        self._spec = spec
        self._plugin = plugin.resolve() if plugin else None

    @property
    def plugin(self) -> Path:
        """The SPANK plugin plugstack.conf loads: the checkout's, or for a Slurm from a root the one
        ``up`` builds against that root's headers into the state directory."""
        if self._plugin is not None:
            return self._plugin
        return self.paths.plugin if self.spec.in_root else DEFAULT_PLUGIN.resolve()

    @property
    def root(self) -> DebianRoot | None:
        version = VERSIONS[self.spec.slurm_version]
        return DebianRoot(version) if version.suite else None

    @property
    def view(self) -> RootView | None:
        root = self.root
        return RootView(root, self.paths.root) if root else None

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
        """What a Slurm client needs to talk to this cluster; for a Slurm from a root, PATH starts
        with the state directory's bin/ (wrappers that run that version's clients)."""
        env = {"SLURM_CONF": str(self.paths.slurm_conf)}
        if self.spec.in_root:
            bin_dir = str(self.paths.bin)
            rest = [p for p in os.environ.get("PATH", os.defpath).split(os.pathsep) if p and p != bin_dir]
            env["PATH"] = os.pathsep.join([bin_dir, *rest])
        return env

    def env_lines(self) -> list[str]:
        """Shell lines for ``eval "$(omni cluster env)"``."""
        lines = [f"export SLURM_CONF={shlex.quote(str(self.paths.slurm_conf))}"]
        if self.spec.in_root:
            lines.append(f"export PATH={shlex.quote(str(self.paths.bin))}:\"$PATH\"")
        return lines

    def daemons(self) -> list[Daemon]:
        p, conf = self.paths, str(self.paths.slurm_conf)
        in_root = self.spec.in_root
        root = view_path(p.root) if in_root else None

        def _sbin(cmd: str) -> str:
            return f"/usr/sbin/{cmd}" if in_root else _host_sbin(cmd)

        def _munged(name: str, sock: Path, stem: str) -> Daemon:
            return Daemon(name, (_sbin("munged"), "--foreground", "--force", f"--socket={sock}",
                                 f"--key-file={p.munge_key}", f"--pid-file={p.munge_dir / f'{stem}.pid'}",
                                 f"--log-file={p.munge_dir / f'{stem}.log'}",
                                 f"--seed-file={p.munge_dir / f'{stem}.seed'}", *munged_threads(self.spec)),
                          p.munge_dir / ("omni.pid" if stem == "munged" else f"omni-{stem}.pid"),
                          p.munge_dir / f"{stem}.out", root)

        out = [_munged("munged", p.munge_socket, "munged")]
        node_conf = conf
        if node_munged(self.spec):   # the nodes' own munged, the one key (spec.node_munged)
            out.append(_munged(NODE_MUNGED, p.node_munge_socket, "munged-nodes"))
            node_conf = str(p.node_slurm_conf)
        out.append(Daemon("slurmctld", (_sbin("slurmctld"), "-D", "-f", conf),
                          p.ctld_dir / "omni.pid", p.ctld_dir / "slurmctld.out", root))
        for node in self.spec.node_names:
            d = p.node_dir(node)
            out.append(Daemon(f"slurmd:{node}", (_sbin("slurmd"), "-D", "-N", node, "-f", node_conf),
                              d / "omni.pid", d / "slurmd.out", root))
        return out

    def running(self) -> dict[str, int | None]:
        """Each daemon's pid if it is alive and is the program we started, else None."""
        return {d.name: _live_pid(d) for d in self.daemons()}

    # -- up -----------------------------------------------------------------------------------------
    def up(self, wait_s: float = 90.0) -> bool:
        """Bring the cluster up; returns False when everything was already running (a no-op)."""
        check_packages(self.spec)
        recorded = self.recorded_spec()
        alive = self.running()
        if recorded is not None and self._spec is not None and recorded != self._spec and any(alive.values()):
            raise ClusterError(f"cluster: couldn't reshape the running cluster in {self.paths.root} "
                               "(run 'omni cluster down' first)")
        view = self.view
        if alive and all(alive.values()) and self.paths.slurm_conf.exists() and (view is None or view.mounted()):
            log.info("cluster already up in %s", self.paths.root)
            if view is not None and self._plugin is None:
                self.build_plugin()   # make is incremental: rebuilt only when spank/ changed
            self._write_plugstack()
            return False
        fresh = not any(alive.values())
        if view is not None and not view.mounted():
            if not fresh:
                raise ClusterError(f"cluster: couldn't restart daemons in {self.paths.root}: their Debian "
                                   "root is not mounted (run 'omni cluster down' first)")
            self._prepare_root(view)
        elif view is not None and self._plugin is None:
            self.build_plugin()
        self._write_files()
        _raise_open_files()
        restarted = []
        batch: list[subprocess.Popen[bytes]] = []
        for daemon in self.daemons():
            if alive.get(daemon.name) is None:
                # A fresh cluster starts clean (-c: no jobs or node states from an earlier run); a
                # slurmctld restarted under live slurmds keeps its state.
                batch.append(self._start(daemon, extra=("-c",) if fresh and daemon.name == "slurmctld" else ()))
                restarted.append(daemon.name.removeprefix("slurmd:"))
                sock = {"munged": self.paths.munge_socket, NODE_MUNGED: self.paths.node_munge_socket}.get(daemon.name)
                if sock is not None:
                    self._wait_for(sock.exists, 10, f"{daemon.name}'s socket")
            # slurmd start in batches, each checked before the next: hundreds at once on two cores
            # would all register with slurmctld in the same second
            if len(batch) >= START_BATCH or not daemon.name.startswith("slurmd:"):
                self._settle(batch)
                batch = []
        self._settle(batch)
        self._link_system_conf()
        wait_s += WAIT_PER_NODE_S * self.spec.nodes
        if fresh:
            self.wait_idle(wait_s)
        else:
            self.wait_responding(set(restarted) & set(self.spec.node_names), wait_s)
        return True

    def _prepare_root(self, view: RootView) -> None:
        """The Debian root (built once, cached), this state directory's view of it, the client
        wrappers, and the SPANK plugin built against that root's headers."""
        info = view.root.ensure()
        view.mount(job_binds(PROJECT, self.paths.root, extra=(Path(sys.prefix),)))
        self.paths.bin.mkdir(parents=True, exist_ok=True)
        for cmd in CLIENTS:
            wrapper = self.paths.bin / cmd
            write_atomic(wrapper, render_client_wrapper(view.path, cmd, info.get("slurm_version", "?")), mode=0o644, durable=False)
            wrapper.chmod(0o755)
        if self._plugin is None:
            self.build_plugin()

    def build_plugin(self) -> Path:
        """``make -C spank SLURM_ROOT=<root> BUILD_DIR=<state>/spank``: SPANK_PLUGIN() stamps the
        version of the headers it was built with, and slurmd refuses a plugin of another version."""
        root = self.root
        if root is None:
            return DEFAULT_PLUGIN
        out = self.paths.plugin.parent
        out.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["make", "-s", "-C", str(PROJECT / "spank"), f"SLURM_ROOT={root.path}",
                               f"BUILD_DIR={out}"], capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0:
            line = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["exit"]
            raise ClusterError(f"cluster: couldn't build the SPANK plugin against Slurm "
                               f"{self.spec.slurm_version}'s headers: {line[0]}")
        return self.paths.plugin

    def _write_files(self) -> None:
        p, spec = self.paths, self.spec
        for d in (p.root, p.etc, p.munge_dir, p.ctld_dir, p.ctld_dir / "state", p.dev):
            d.mkdir(parents=True, exist_ok=True)
        p.munge_dir.chmod(0o711)   # users reach the socket (0777); the key stays 0400 root's
        # The site layout (docs/deployment.md): the spool root is root's and 0755; each user's
        # <spool>/<user> is 0700 and made by the SPANK plugin on the first record.
        p.spool.mkdir(mode=0o755, parents=True, exist_ok=True)
        p.spool.chmod(0o755)
        if not p.munge_key.exists():
            _write_private(p.munge_key, secrets.token_bytes(1024))
        for node in spec.node_names:
            (p.node_dir(node) / "spool").mkdir(parents=True, exist_ok=True)
            for gpu in p.gpu_files(node, spec.gpus_per_node):
                gpu.parent.mkdir(parents=True, exist_ok=True)
                if not gpu.exists():
                    # The same major/minor as /dev/null: a character device slurmd accepts as a GPU.
                    os.mknod(gpu, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        write_atomic(p.etc / "slurm.conf", render_slurm_conf(spec, p), mode=0o644, durable=False)
        if node_munged(spec):
            write_atomic(p.node_slurm_conf, render_slurm_conf(spec, p, for_nodes=True), mode=0o644, durable=False)
        else:
            p.node_slurm_conf.unlink(missing_ok=True)
        write_atomic(p.etc / "topology.conf", render_topology_conf(spec), mode=0o644, durable=False)
        write_atomic(p.etc / "gres.conf", render_gres_conf(spec, p), mode=0o644, durable=False)
        if spec.in_root:
            write_atomic(p.etc / "cgroup.conf", render_cgroup_conf(), mode=0o644, durable=False)
        self._write_plugstack()
        write_atomic(p.record, json.dumps({"spec": asdict(spec), "plugin": str(self.plugin)}, indent=2), mode=0o644, durable=False)

    def _write_plugstack(self) -> None:
        plugin = self.plugin if self.plugin.exists() else None
        write_atomic(self.paths.etc / "plugstack.conf", render_plugstack_conf(plugin, self.paths), mode=0o644, durable=False)

    def _start(self, daemon: Daemon, extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        daemon.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(daemon.log_file, "ab") as out:
            prefix = ["/usr/sbin/chroot", str(daemon.root)] if daemon.root else []
            proc = subprocess.Popen([*prefix, *daemon.argv, *extra], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **self.env})
        write_atomic(daemon.pid_file, f"{proc.pid}\n", mode=0o644, durable=False)
        log.info("started %s (pid %d)", daemon.name, proc.pid)
        return proc

    def _settle(self, procs: list[subprocess.Popen[bytes]]) -> None:
        """A moment for the daemons just started, then every one must still run."""
        if not procs:
            return
        time.sleep(0.05 + 0.01 * len(procs))
        by_pid = {int(d.pid_file.read_text()): d for d in self.daemons() if d.pid_file.exists()}
        for proc in procs:
            if proc.poll() is not None:
                d = by_pid.get(proc.pid)
                name, where = (d.name, d.log_file) if d else (str(proc.args), self.paths.root)
                raise ClusterError(f"cluster: couldn't start {name}: exited {proc.returncode} (see {where})")

    def _link_system_conf(self) -> None:
        # Plain `sinfo` reads /etc/slurm/slurm.conf; point it at us only where no system Slurm is configured,
        # and only for the host's own version (its clients cannot talk to a newer slurmctld).
        if self.spec.in_root:
            return
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
        view = self.view
        if view is not None:
            unmounted = view.unmount()
            if unmounted:
                stopped.append(f"{len(unmounted)} mounts")
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
        # Inside a root's view a job's files read as <view>/<host path> from out here.
        prefixes = (str(self.paths.root), str(view_path(self.paths.root)))
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
            if any(_under(p, prefixes) for p in paths):
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


def _under(path: str, roots: tuple[str, ...]) -> bool:
    """``path`` is one of ``roots`` or inside one (``/s/cluster-scale/x`` is not inside ``/s/cluster``)."""
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _raise_open_files() -> None:
    """The soft open-file limit up to the hard one, for the daemons started from here: slurmctld
    holds a connection per node while it talks to hundreds of slurmd at once."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError) as e:
        log.info("open-file limit unchanged: %s", e)


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
