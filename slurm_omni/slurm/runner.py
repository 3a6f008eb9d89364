"""The one place that runs external commands.

argv lists only (never a shell), a timeout on every call, retries with exponential backoff while
slurmctld is unreachable, and a bounded call rate so that no loop can hammer slurmctld.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from slurm_omni.errors import SlurmError, SlurmUnreachable

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
