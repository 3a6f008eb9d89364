"""The one-node read of Slurm (``csrc/node_read.c``, ``omni-node-read``): a kept process that answers
``scontrol show node NAME``'s text for one node with one RPC of that node's record, where scontrol loads
every node of the cluster. Built at set-up (``python -m slurm_omni.slurm.node_read``, by
``scripts/setup.sh``) against the host's libslurm; :class:`runner.ScontrolSession` reads one node through
it when it is built and answers, and through its scontrol otherwise.

Why: the read that confirms a node srun reported failed runs while the node loss tears the step down. At
512 emulated nodes scontrol's ``show node`` of the lost node asked slurmctld for all 512 records, and the
read answered 0.04-0.10 s after it was asked, against 0.00-0.01 s at 8 nodes (scale bench, 2026-12-03
22:55-23:17, with the nodes' own munged); a record for each node of the cluster is work that grows with
the cluster, not with what is asked.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from slurm_omni.native import BUILD_ROOT, BuildError, build_hashed, hashed_path

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).resolve().parent / "csrc" / "node_read.c",)
BUILD_DIR = BUILD_ROOT / "node-read"
CFLAGS = ("-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wformat=2", "-Wshadow",
          "-fstack-protector-strong", "-D_FORTIFY_SOURCE=2", "-fPIE", "-pie", "-Wl,-z,relro,-z,now")
"""As spank/Makefile's, for a program."""
END = "omninodereadend"
"""The word the program prints after each answer (and once when it is ready)."""


def end_kept(proc: subprocess.Popen[bytes] | None) -> None:
    """A kept process that reads commands on its stdin ended: its pipes closed, killed, reaped."""
    if proc is None:
        return
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def program_path(dest: Path | None = None) -> Path:
    """Where the program built from today's source and flags is (or would be)."""
    return hashed_path(SOURCES, CFLAGS, BUILD_DIR if dest is None else dest, "omni-node-read")


def build(dest: Path | None = None) -> Path:
    """The program compiled into ``dest`` against the host's libslurm (nothing to do when it is there)."""
    return build_hashed(SOURCES, CFLAGS, BUILD_DIR if dest is None else dest, "omni-node-read", libs=("-lslurm",))


class NodeReader:
    """One ``omni-node-read`` process, started on the first read (or :meth:`warm`). :meth:`show` answers a
    node's record text, or None where the caller reads it otherwise: not built, not started, no answer
    within the wait (the caller's read would wait as long again), or Slurm's error through this library
    (another Slurm's cluster, slurmctld down: the caller's own read says which), after which it is not used
    again. Not thread-safe: its caller holds a
    lock (``ScontrolSession``)."""

    def __init__(self, env: Mapping[str, str], program: Path | None = None) -> None:
        """``env``: the environment of the Slurm commands (``SLURM_CONF``)."""
        self._env = dict(env)
        self._program = program_path() if program is None else program
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self.unusable = False
        self.why = ""
        """Why it stepped aside for good (one line), empty while it serves."""

    def warm(self, wait_s: float) -> bool:
        """Started and ready (slurm.conf and the plugins loaded; no RPC yet)."""
        return self._ready(wait_s)

    def show(self, name: str, wait_s: float) -> str | None:
        start = time.monotonic()
        if not self._ready(wait_s):
            return None
        proc = self._proc
        if proc is None or proc.stdin is None:   # started with both pipes: never, but typed
            return None
        try:
            proc.stdin.write(name.encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            self._give_up("its pipe closed")
            return None
        lines = self._until_end(start + wait_s)
        if lines is None:
            return None
        if lines and lines[0].startswith("error: "):
            self._give_up(lines[0])
            return None
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        proc, self._proc = self._proc, None
        end_kept(proc)

    def _ready(self, wait_s: float) -> bool:
        if self.unusable:
            return False
        if self._proc is not None and self._proc.poll() is None:
            return True
        self.close()
        if not self._program.exists():
            self._give_up(f"not built ({self._program.name} is not in {self._program.parent}; scripts/setup.sh builds it)")
            return False
        try:
            self._proc = subprocess.Popen([str(self._program), END], env=self._env, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError as e:
            self._give_up(f"couldn't start {self._program}: {e}")
            return False
        self._buf = b""
        if self._until_end(time.monotonic() + wait_s) is None:   # its first line: ready
            self._give_up("no first answer")
            return False
        return True

    def _until_end(self, deadline: float) -> list[str] | None:
        """The lines before the next end word; None (the process ended) when it is not read in time."""
        proc = self._proc
        if proc is None or proc.stdout is None:   # started with both pipes: never, but typed
            return None
        fd = proc.stdout.fileno()
        while True:
            head, sep, rest = self._buf.partition(f"{END}\n".encode())
            if sep and (not head or head.endswith(b"\n")):
                self._buf = rest
                return head.decode("utf-8", errors="replace").splitlines()
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:   # the caller's read waits as long again
                self._give_up("no answer in time")
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self._give_up(f"ended (exit {proc.wait()})")
                return None
            self._buf += chunk

    def _give_up(self, why: str) -> None:
        self.close()
        self.unusable, self.why = True, why
        log.debug("node reader: %s: each read of a node runs through scontrol", why)


def main() -> int:
    try:
        print(f"slurm: built {build()}")
    except BuildError as e:
        print(f"slurm: the one-node read: {e} (reads of a node run through scontrol)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
