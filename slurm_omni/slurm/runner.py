"""The one place that runs external commands.

argv lists only (never a shell), a timeout on every call, retries with exponential backoff while
slurmctld is unreachable, and a bounded call rate so that no loop can hammer slurmctld.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import select
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from slurm_omni.errors import SlurmError, SlurmUnreachable
from slurm_omni.slurm.node_read import NodeReader, end_kept

log = logging.getLogger(__name__)

# What Slurm 22.05 clients print when slurmctld is down, starting or overloaded.
UNREACHABLE_MARKERS = (
    "Unable to contact slurm controller",
    "Socket timed out on send/recv operation",
    "Connection refused",
    "Slurm backup controller in standby mode",
    "Zero Bytes were transmitted or received",
    "Communication connection failure",
)

CLUSTER_ENV = ("SLURM_CONF",)
"""Variables a replaced environment never brings: which cluster a command talks to is this process's."""


@dataclass(frozen=True, slots=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class RateLimiter:
    """At most ``rate`` calls per second on average, bursts up to ``burst`` (a token bucket)."""

    def __init__(self, rate: float, burst: int) -> None:
        self._rate, self._burst = rate, float(burst)
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self) -> float:
        """Take one token, sleeping if needed; returns the seconds slept."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
            self._last = now
            wait = 0.0 if self._tokens >= 1 else (1 - self._tokens) / self._rate
            self._tokens -= 1
        if wait > 0:
            time.sleep(wait)
        return wait


class CommandRunner:
    """Runs commands for the Slurm boundary.

    ``env`` is merged over the process environment (e.g. ``SLURM_CONF`` of the embedded cluster).
    A call's own ``env`` replaces the process environment instead (the manager resubmits a job with
    the environment its user submitted it from); the runner's ``env`` still goes over it, and
    ``SLURM_CONF`` stays this process's, so the command talks to the same cluster.
    """

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        *,
        timeout_s: float = 30.0,
        retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        rate_per_s: float = 20.0,
        burst: int = 20,
    ) -> None:
        self.env = dict(env or {})
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.limiter = RateLimiter(rate_per_s, burst)
        self.calls = 0

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float | None = None,
        check: bool = True,
        retry_unreachable: bool = True,
        input_text: str | None = None,
        cwd: str | None = None,
        unreachable_if: Callable[[CommandResult], bool] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run ``argv``; ``unreachable_if`` flags outputs that mean "slurmctld did not answer" even with
        exit 0 (``sinfo --json`` in 22.05 exits 0 with an "Unspecified error" in its JSON). ``env``:
        the command's whole environment instead of this process's (see the class)."""
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise SlurmError(f"runner: couldn't run {argv!r}: argv must be a non-empty list of strings")
        env = self.environment(env)
        attempts = 1 + (self.retries if retry_unreachable else 0)
        delay = self.backoff_s
        for attempt in range(1, attempts + 1):
            result = self._once(tuple(argv), env, timeout_s or self.timeout_s, input_text, cwd)
            if unreachable_if is not None and result.ok and unreachable_if(result):
                result = dataclasses.replace(result, returncode=-1, stderr=result.stderr + "\n"
                                             + UNREACHABLE_MARKERS[0] + " (reported in the output)")
            if result.ok or not _unreachable(result.stderr) or attempt == attempts:
                break
            log.warning("%s: slurmctld unreachable (attempt %d/%d), retrying in %.1fs",
                        argv[0], attempt, attempts, delay)
            time.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)
        if check and not result.ok:
            line = _first_line(result.stderr) or _first_line(result.stdout) or f"exit {result.returncode}"
            exc = SlurmUnreachable if _unreachable(result.stderr) else SlurmError
            raise exc(f"{argv[0]}: couldn't {' '.join(argv[1:3])}: {line}")
        return result

    def spawn(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              stdout: int | None = None, stderr: int | None = None, detach: bool = False) -> subprocess.Popen[bytes]:
        """Start a long-running command (an srun step) and return at once: argv list, never a shell,
        the call rate bounded like ``run``. ``env`` is merged over the runner's environment. The
        caller waits for it (its exit code is the step's). ``detach``: in a session of its own, so
        that it outlives its caller and the caller's terminal (salloc, a step supervisor)."""
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise SlurmError(f"runner: couldn't start {argv!r}: argv must be a non-empty list of strings")
        waited = self.limiter.acquire()
        self.calls += 1
        # the scale bench reads these (with --log-level debug) to split a recovery's decide and launch
        log.debug("started %s (rate limit %.3fs)", tuple(argv), waited)
        try:
            return subprocess.Popen(list(argv), env={**self.environment(), **(env or {})}, stdin=subprocess.DEVNULL,
                                    stdout=stdout, stderr=stderr, start_new_session=detach)
        except FileNotFoundError as e:
            raise SlurmError(f"{argv[0]}: couldn't start: command not found (install the Slurm client "
                             f"packages: scripts/setup.sh)") from e

    def environment(self, replace: Mapping[str, str] | None = None) -> dict[str, str]:
        """What a command runs with: the process environment (or ``replace``), then the runner's."""
        own = {**os.environ, **self.env}
        if replace is None:
            return own
        env = {k: v for k, v in replace.items() if k not in CLUSTER_ENV}
        env.update({k: own[k] for k in CLUSTER_ENV if k in own})
        env.update(self.env)
        return env

    def _once(self, argv: tuple[str, ...], env: dict[str, str], timeout_s: float,
              input_text: str | None, cwd: str | None) -> CommandResult:
        waited = self.limiter.acquire()
        self.calls += 1
        start = time.monotonic()
        try:
            # Slurm prints what users gave it byte for byte (``--job-name=$'\xff'``): one user's bytes that
            # are not UTF-8 must not make every other user's command fail. Replacement leaves valid
            # UTF-8 (every name omni gives a job) exactly as it was.
            proc = subprocess.run(list(argv), env=env, capture_output=True, encoding="utf-8", errors="replace",
                                  timeout=timeout_s, input=input_text, cwd=cwd, check=False)
        except FileNotFoundError as e:
            raise SlurmError(f"{argv[0]}: couldn't run: command not found (install the Slurm client "
                             f"packages: scripts/setup.sh)") from e
        except subprocess.TimeoutExpired as e:
            raise SlurmUnreachable(f"{argv[0]}: couldn't finish within {timeout_s:.0f}s") from e
        duration = time.monotonic() - start
        # the thread names a read beside the supervisor's loop (supervisor/node_reads.py), not a wait of it
        log.debug("ran %s -> %d in %.3fs (rate limit %.3fs) in thread %s", argv, proc.returncode, duration, waited,
                  threading.current_thread().name)
        return CommandResult(argv, proc.returncode, proc.stdout, proc.stderr, duration)


def _unreachable(stderr: str) -> bool:
    return any(marker in stderr for marker in UNREACHABLE_MARKERS)


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


SESSION_END = "omnisessionend"
"""The word a session's ``show hostnames`` echoes after each answer (scontrol prints it itself)."""
SESSION_WAIT_S = 5.0
"""The longest wait for a session's answer; then the read runs as a command of its own (at load 1,000+
the session's slowest of 100 answers took 0.5 s, a command's 7.9 s)."""
SESSION_PROMPT = "scontrol: "
"""What an interactive scontrol writes before each command it reads (with readline, our line after it)."""
_SESSION_WORD = re.compile(r"[A-Za-z0-9_.,\[\]-]+")
"""What a session writes after ``show node``: a host list, nothing that could end the line or start
another command (anything else is read with a command of its own, as argv)."""


_ONE_NODE = re.compile(r"[A-Za-z0-9_.-]+")
"""One node's name (no host list): read through the node reader."""


class ScontrolSession:
    """One long-lived ``scontrol`` reading its commands on stdin (its interactive mode), for the reads
    that must answer at once under load: a new ``scontrol`` per read pays a process start (fork, exec,
    libslurm, slurm.conf) that a loaded machine stretches. At 512 emulated nodes at load 650-1,250 a
    one-node ``scontrol show node`` took 14 ms median, 400 ms at the 90th percentile and 7.9 s at most
    as a command of its own; the same read in one kept process 3.7 ms, 20 ms and 0.5 s (100 reads
    side by side, 2026-12-03). Each ``show node`` is followed by ``show hostnames END<n>``, which
    scontrol answers itself (no RPC): the answer ends at the line that echoes it. Its stdout is made
    line-buffered with ``stdbuf`` (a pipe is otherwise written in blocks). One caller at a time: a
    caller that finds it busy, or a session that cannot run (no ``stdbuf``, scontrol gone, no answer
    within :data:`SESSION_WAIT_S`: that process is ended, the next read starts another), gets None and
    runs the command as before; a session whose first process never answered is not tried again."""

    def __init__(self, runner: CommandRunner, node_reader: bool = False) -> None:
        self._runner = runner
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._asked = 0
        self._unusable = False
        self._reader: NodeReader | None = NodeReader(runner.environment()) if node_reader else None
        """The one-node read (``node_read.py``): one node's record in one RPC, where scontrol loads them all."""

    @property
    def usable(self) -> bool:
        """False once the session stepped aside for good (no ``stdbuf``, its first process never answered)."""
        return not self._unusable

    def show_node(self, names: str, timeout_s: float) -> str | None:
        """``scontrol show node NAMES``'s output, or None: the caller runs the command."""
        if self._unusable or not _SESSION_WORD.fullmatch(names) or not self._lock.acquire(blocking=False):
            return None
        try:
            if self._reader is not None and _ONE_NODE.fullmatch(names):
                start = time.monotonic()
                text = self._reader.show(names, min(timeout_s, SESSION_WAIT_S))
                if text is not None:
                    self._runner.calls += 1
                    return self._answered(names, text, start, "node reader")
            return self._show(names, timeout_s)
        finally:
            self._lock.release()

    def update(self, words: Sequence[str], timeout_s: float) -> str | None:
        """``scontrol update WORDS``'s output through the session (a drill's or the scale bench's fault
        sent as one RPC at a known instant, no process start before it), or None: the caller runs the
        command. Each word must be ``key=value`` of :data:`_SESSION_WORD`'s characters (a reason's
        spaces would end the command: such an update runs as a command of its own)."""
        if (self._unusable or not words or not all(_SESSION_WORD.fullmatch(w.replace("=", "", 1)) for w in words)
                or not self._lock.acquire(blocking=False)):
            return None
        try:
            command = " ".join(("update", *words))
            text = self._ask(command.encode(), timeout_s)
            if text is not None and (first := _first_line(text)):   # an update prints nothing unless it failed
                raise (SlurmUnreachable if _unreachable(text) else SlurmError)(f"scontrol: couldn't {command}: {first}")
            return None if text is None else ""
        finally:
            self._lock.release()

    def warm(self) -> bool:
        """Start the process and wait for its first answer (``show hostnames``: no RPC), so that the
        first read pays no process start (512 emulated nodes: the node srun reported failed read in
        0.13 s by a session started for it). False when busy or unusable."""
        if self._unusable or not self._lock.acquire(blocking=False):
            return False
        try:
            if self._reader is not None:
                self._reader.warm(SESSION_WAIT_S)
            return self._ask(b"", SESSION_WAIT_S) is not None
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._stop()
            if self._reader is not None:
                self._reader.close()

    def _start(self) -> subprocess.Popen[bytes] | None:
        try:
            return subprocess.Popen(["stdbuf", "-oL", "-eL", "scontrol"], env=self._runner.environment(),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except OSError as e:
            self._unusable = True
            log.debug("scontrol session: couldn't start (%s): each read runs scontrol", e)
            return None

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        end_kept(proc)

    def _show(self, names: str, timeout_s: float) -> str | None:
        waited = self._runner.limiter.acquire()
        self._runner.calls += 1
        start = time.monotonic()
        text = self._ask(b"show node " + names.encode(), timeout_s)
        if text is None:
            return None
        return self._answered(names, text, start, f"rate limit {waited:.3f}s, scontrol session")

    @staticmethod
    def _answered(names: str, text: str, start: float, how: str) -> str:
        """A ``show node`` answer (from the session's scontrol or the node reader) logged and checked:
        Slurm's error as one line."""
        log.debug("ran %s -> 0 in %.3fs (%s) in thread %s", ("scontrol", "show", "node", names),
                  time.monotonic() - start, how, threading.current_thread().name)
        first = _first_line(text)
        if first and not first.startswith("NodeName="):
            raise (SlurmUnreachable if _unreachable(text) else SlurmError)(f"scontrol: couldn't show node: {first}")
        return text

    def _ask(self, command: bytes, timeout_s: float) -> str | None:
        """``command`` (none: only the end's echo) through the session's process, started if needed:
        what scontrol printed for it, or None (no process, no answer within the wait)."""
        start = time.monotonic()
        proc, fresh = self._proc, False
        if proc is None or proc.poll() is not None:
            self._stop()
            proc, fresh = self._start(), True
            self._proc = proc
        if proc is None or proc.stdin is None or proc.stdout is None:   # started with both pipes: never, but typed
            return None
        self._asked += 1
        end = f"{SESSION_END}{self._asked}".encode()
        try:
            proc.stdin.write((command + b"\n" if command else b"") + b"show hostnames " + end + b"\n")
            proc.stdin.flush()
        except OSError:
            self._stop()
            return None
        fd, buf, kept = proc.stdout.fileno(), b"", list[str]()
        echoes = (command.decode(), f"show hostnames {end.decode()}")
        while True:
            *lines, buf = buf.split(b"\n")
            done = False
            for raw in lines:
                line = raw.decode("utf-8", errors="replace")
                while line.startswith(SESSION_PROMPT):   # its prompt, and readline's echo of our line
                    line = line[len(SESSION_PROMPT):]
                if line.encode() == end:
                    done = True
                    break
                if line not in echoes:
                    kept.append(line)
            if done:
                break
            left = start + min(timeout_s, SESSION_WAIT_S) - time.monotonic()
            if left <= 0:   # the command of its own has the caller's time (a session that never answers: not again)
                self._stop()
                self._unusable = self._unusable or fresh
                log.debug("scontrol session: no answer to %r within %.1f s", command.decode(),
                          min(timeout_s, SESSION_WAIT_S))
                return None
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:   # scontrol ended: this read runs as a command of its own
                self._stop()
                if fresh:   # it ended before its first answer (stdbuf could not run it): not tried again
                    self._unusable = True
                    log.debug("scontrol session: ended before its first answer (%s): each read runs scontrol",
                              _first_line("\n".join(kept) + buf.decode("utf-8", errors="replace")) or "no output")
                return None
            buf += chunk
        return "\n".join(kept) + "\n"

