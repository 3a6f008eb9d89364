"""A newer Slurm from a Debian root: build it once (cached), mount a view of it per state directory.

The cached root (``versions.roots_dir()/<suite>``) is made by ``debootstrap --variant=minbase`` from
the mirror this machine's apt sources name, with Slurm, munge and the headers installed by apt inside
it. Each state directory mounts its own view, ``<state>/root``: a private bind of the cached root
with /proc, /dev, /sys, /tmp, /home, the project, its venv, its Python and the state directory bound in at
their own paths, so that daemons and jobs inside see the same paths as the host. The view lives under
/run/slurm-omni/views/ (``OMNI_SLURM_VIEWS``), not in the state directory: an ``rm -rf`` of a state
directory must never walk through the binds into the project. Every mount made is recorded in
``<state>/mounts.json`` and ``down`` unmounts exactly those, in reverse order.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from slurm_omni.cluster.versions import (
    PYTHON_RUNTIME_PACKAGES,
    ROOT_PACKAGES,
    SlurmVersion,
    debian_mirror,
    read_apt_sources,
    roots_dir,
)
from slurm_omni.errors import ClusterError

log = logging.getLogger(__name__)

MARKER = ".omni-root"
"""A JSON file at the top of a finished root (suite, Slurm version, mirror); also how a wrapper
knows it already runs inside a root."""

CLIENTS = ("sinfo", "squeue", "sbatch", "scontrol", "srun", "strigger", "scancel", "salloc", "sacct",
           "sstat", "sattach", "sprio", "sshare", "sdiag")


def _run(argv: list[str], what: str, timeout_s: float = 900, log_file: Path | None = None) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterError(f"cluster: couldn't {what}: {e}") from e
    if log_file is not None:
        with open(log_file, "a") as f:
            f.write(f"$ {shlex.join(argv)}\n{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise ClusterError(f"cluster: couldn't {what}: {tail[0]}"
                           + (f" (see {log_file})" if log_file else ""))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class DebianRoot:
    """The cached root of one Debian suite."""

    def __init__(self, version: SlurmVersion, base: Path | None = None) -> None:
        if version.suite is None:
            raise ClusterError(f"cluster: Slurm {version.version} is the host's own: no root to build")
        self.version = version
        self.base = base or roots_dir()
        self.path = self.base / version.suite

    def info(self) -> dict[str, str] | None:
        try:
            data = json.loads((self.path / MARKER).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def ensure(self) -> dict[str, str]:
        """The root, built first if it is not there yet (once: later calls and other state
        directories reuse it; a half-built one is never used)."""
        info = self.info()
        if info is not None:
            return info
        with _locked(self.base / f"{self.version.suite}.lock"):
            info = self.info()
            if info is None:
                self._build()
                info = self.info()
        if info is None:
            raise ClusterError(f"cluster: couldn't build the {self.version.suite} root in {self.path}")
        return info

    def _build(self) -> None:
        for cmd in ("debootstrap", "chroot"):
            if shutil.which(cmd) is None and not Path("/usr/sbin", cmd).exists():
                raise ClusterError(f"cluster: couldn't build a Slurm {self.version.version} root: {cmd} "
                                   "is missing (apt-get install -y debootstrap, or scripts/setup.sh)")
        if os.geteuid() != 0:
            raise ClusterError(f"cluster: couldn't build a Slurm {self.version.version} root: "
                               "debootstrap and chroot need root")
        mirror = os.environ.get("OMNI_DEBIAN_MIRROR") or debian_mirror(read_apt_sources())
        if not mirror:
            raise ClusterError("cluster: couldn't find a Debian mirror in /etc/apt/sources.list or "
                               "/etc/apt/sources.list.d (set OMNI_DEBIAN_MIRROR)")
        suite = self.version.suite or ""
        tmp = self.base / f"{suite}.tmp"
        logf = self.base / f"{suite}.build.log"
        if tmp.exists():
            shutil.rmtree(tmp)
        start = time.monotonic()
        log.info("building the %s root in %s from %s (once)", suite, self.path, mirror)
        _run(["debootstrap", "--variant=minbase", suite, str(tmp), mirror], f"debootstrap {suite}",
             log_file=logf)
        # No service may start inside the root at install time; a frozen mirror's Release may be past
        # its Valid-Until (a snapshot), which apt refuses by default.
        policy = tmp / "usr/sbin/policy-rc.d"
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        (tmp / "etc/apt/apt.conf.d/99slurm-omni").write_text('Acquire::Check-Valid-Until "false";\n')
        _run(["chroot", str(tmp), "apt-get", "update", "-qq"], f"apt-get update in the {suite} root",
             log_file=logf)
        _run(["chroot", str(tmp), "apt-get", "install", "-y", "-qq", "--no-install-recommends",
              *ROOT_PACKAGES, *PYTHON_RUNTIME_PACKAGES], f"install Slurm in the {suite} root", log_file=logf)
        _run(["chroot", str(tmp), "apt-get", "clean"], "clean apt's cache", log_file=logf)
        version = _slurm_version_in(tmp)
        if not version.startswith(self.version.version + "."):
            raise ClusterError(f"cluster: the {suite} root has Slurm {version}, not {self.version.version}"
                               f" (see {logf})")
        (tmp / MARKER).write_text(json.dumps({"suite": suite, "slurm_version": version, "mirror": mirror,
                                              "built_s": round(time.monotonic() - start, 1)}) + "\n")
        if self.path.exists():
            shutil.rmtree(self.path)
        tmp.rename(self.path)
        log.info("built the %s root (Slurm %s) in %.0fs", suite, version, time.monotonic() - start)


def _slurm_version_in(root: Path) -> str:
    proc = subprocess.run(["chroot", str(root), "/usr/sbin/slurmctld", "-V"], capture_output=True, text=True,
                          timeout=60, check=False)
    words = proc.stdout.split()
    if proc.returncode != 0 or len(words) < 2:
        raise ClusterError(f"cluster: couldn't run slurmctld -V in {root}: {proc.stderr.strip()}")
    return words[1]


@dataclass(frozen=True, slots=True)
class Bind:
    source: Path
    target: Path          # inside the view, e.g. /proc
    kind: str = "bind"    # "bind" | "proc"
    read_only: bool = False


def job_binds(project: Path, state_dir: Path, extra: tuple[Path, ...] = ()) -> list[Bind]:
    """What daemons and jobs need inside the root, at the host's paths."""
    py_real = Path(os.path.realpath(sys.executable))
    venv = Path(sys.prefix)
    stdlib = Path(sysconfig.get_paths(vars={"installed_base": sys.base_prefix,
                                             "base": sys.base_prefix})["stdlib"])
    binds = [
        Bind(Path("proc"), Path("/proc"), kind="proc"),
        Bind(Path("/dev"), Path("/dev")),
        Bind(Path("/dev/pts"), Path("/dev/pts")),
        Bind(Path("/dev/shm"), Path("/dev/shm")),
        Bind(Path("/sys"), Path("/sys"), read_only=True),
        Bind(Path("/tmp"), Path("/tmp")),
        # The job owners' homes: their log folders and files live there (slurmstepd opens --output
        # inside the view: "Could not open stdout file /home/alice/...: No such file or directory").
        Bind(Path("/home"), Path("/home")),
        # Job owners resolve to the same uids as on the host (users made with useradd).
        Bind(Path("/etc/passwd"), Path("/etc/passwd"), read_only=True),
        Bind(Path("/etc/group"), Path("/etc/group"), read_only=True),
        Bind(Path("/etc/hosts"), Path("/etc/hosts"), read_only=True),
        Bind(py_real, py_real, read_only=True),
        Bind(stdlib, stdlib, read_only=True),
        Bind(project, project),
    ]
    for path in (venv, state_dir, *extra):
        if not _under(path, [b.target for b in binds if b.kind == "bind" and b.source.is_dir()]):
            binds.append(Bind(path, path))
    return [b for b in binds if b.kind == "proc" or b.source.exists()]


def _under(path: Path, dirs: list[Path]) -> bool:
    return any(path == d or d in path.parents for d in dirs if d != Path("/"))


def view_path(state_dir: Path) -> Path:
    """Where a state directory's view of its root is mounted (one per state directory)."""
    base = Path(os.environ.get("OMNI_SLURM_VIEWS") or "/run/slurm-omni/views")
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return base / f"{state_dir.resolve().name}-{digest}"


class RootView:
    """One state directory's mounted view of a cached root, at ``<state>/root``."""

    def __init__(self, root: DebianRoot, state_dir: Path) -> None:
        self.root = root
        self.state_dir = state_dir
        self.path = view_path(state_dir)
        self.record = state_dir / "mounts.json"

    def recorded(self) -> list[str]:
        try:
            data = json.loads(self.record.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            raise ClusterError(f"cluster: couldn't read {self.record}: {e} (unmount by hand: findmnt -R "
                               f"{self.path})") from e
        return [str(t) for t in data.get("mounts", [])]

    def mounted(self) -> bool:
        rec = self.recorded()
        points = mount_points()
        return bool(rec) and all(t in points for t in rec)

    def mount(self, binds: list[Bind]) -> None:
        """Mount the view (a no-op when every recorded mount is still there)."""
        if self.mounted():
            return
        self.unmount()      # whatever part of an earlier view is left
        self.path.mkdir(parents=True, exist_ok=True)
        self.record.parent.mkdir(parents=True, exist_ok=True)
        done: list[str] = []

        def remember(target: Path) -> None:
            done.append(str(target))
            _write_json(self.record, {"root": str(self.root.path), "mounts": done})

        try:
            # Recorded before it is made: a crash in between leaves a record naming it, never a
            # mount nobody knows of (unmount() skips what /proc/self/mountinfo does not list).
            remember(self.path)
            _mount(["--bind", str(self.root.path), str(self.path)], self.path)
            # Private: what is mounted below the view must not show up in the cached root or elsewhere.
            _mount(["--make-private", str(self.path)], self.path)
            for b in binds:
                target = self.path / b.target.relative_to("/")
                if b.source.is_dir() or b.kind == "proc":
                    target.mkdir(parents=True, exist_ok=True)
                elif not target.exists() and not target.is_symlink():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.touch()
                remember(target)
                if b.kind == "proc":
                    _mount(["-t", "proc", "proc", str(target)], target)
                else:
                    _mount(["--bind", str(b.source), str(target)], target)
                if b.read_only:
                    _mount(["-o", "remount,bind,ro", str(target)], target)
            self._link_python()
        except ClusterError:
            self.unmount()
            raise

    def _link_python(self) -> None:
        """The venv's python links to /usr/bin/python3 -> python3.11: the same links inside."""
        link = Path(sys.base_prefix) / "bin" / "python3"
        inside = self.path / link.relative_to("/")
        if link.is_symlink() and not inside.exists() and not inside.is_symlink():
            inside.symlink_to(os.readlink(link))

    def unmount(self) -> list[str]:
        """Unmount what the record names, in reverse; returns what was unmounted."""
        rec = self.recorded()
        gone = []
        for target in reversed(rec):
            if target not in mount_points():
                continue
            proc = subprocess.run(["umount", target], capture_output=True, text=True, check=False, timeout=30)
            if proc.returncode != 0:
                log.warning("umount %s: %s; detaching it lazily", target, proc.stderr.strip())
                subprocess.run(["umount", "-l", target], capture_output=True, text=True, check=False,
                               timeout=30)
            gone.append(target)
        left = [t for t in rec if t in mount_points()]
        if left:
            raise ClusterError(f"cluster: couldn't unmount {left[0]} (busy? fuser -m {left[0]})")
        self.record.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.path.rmdir()   # the empty mount point we made (never anything with files in it)
        return gone


def _mount(args: list[str], target: Path) -> None:
    _run(["mount", *args], f"mount {target}", timeout_s=30)


def mount_points() -> set[str]:
    """Mount points of this mount namespace (/proc/self/mountinfo, octal escapes undone)."""
    points = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4:
                points.add(fields[4].encode().decode("unicode_escape"))
    return points


def _write_json(path: Path, doc: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


def render_client_wrapper(view: Path, command: str, version: str) -> str:
    """A client of the root's Slurm for the host's PATH. Inside the root (a job calling srun) it runs
    the root's own program; outside it enters the view first (chroot as root, an unprivileged user
    namespace otherwise), keeping the working directory. Arguments pass through as "$@": nothing is
    re-parsed by a shell."""
    real = f"/usr/bin/{command}"
    inner = 'cd "$1" 2>/dev/null || { echo "omni: $1 is not visible in the Slurm root; running in /" >&2; ' \
            'cd /; }; shift; exec "$@"'
    tail = f"/bin/sh -c {shlex.quote(inner)} omni-chroot \"$PWD\" {real} \"$@\""
    return (
        "#!/bin/sh\n"
        f"# Generated by slurm-omni: Slurm {version}'s {command}, from {view}.\n"
        f"if [ -e /{MARKER} ]; then exec {real} \"$@\"; fi\n"
        # chroot needs root; anyone else enters through a user namespace that maps them to themselves
        # (munged still sees their real uid: SO_PEERCRED is translated back out of the namespace).
        f"if [ \"$(id -u)\" = 0 ]; then exec /usr/sbin/chroot {shlex.quote(str(view))} {tail}; fi\n"
        f"exec /usr/bin/unshare --user --map-current-user --root={shlex.quote(str(view))} {tail}\n"
    )
