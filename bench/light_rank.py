"""A light training rank for the scale lane (issue 19): the runtime's contract without torch.

    python -S bench/light_rank.py          # as a task of the step supervisor's srun

Standard library only (its C modules, not their Python wrappers) and run with ``-S`` (no site
packages, as the standby client is), so that 2,048 of them fit on one machine (private memory per
rank measured in docs/in-allocation.md, "Scale"). What it keeps of ``slurm_omni.elastic`` (a test decodes its files
with the package's own schemas, tests/supervisor/test_light_rank.py):

- the environment of ``elastic/layout.py``: RANK (or SLURM_PROCID), WORLD_SIZE, OMNI_STAGES,
  OMNI_STAGE, OMNI_DP_SIZE, OMNI_DP_RANK, OMNI_INCARNATION, OMNI_JOB_ID / SLURM_JOB_ID,
  MASTER_ADDR / MASTER_PORT, OMNI_CKPT_DIR, OMNI_HEARTBEAT_DIR, OMNI_METRICS_DIR,
  OMNI_HEARTBEAT_INTERVAL, OMNI_MAX_STEPS, OMNI_STEP_DELAY_S (a step's pace), SLURMD_NODENAME;
- the heartbeat file ``<OMNI_HEARTBEAT_DIR>/rank-<RANK>.json`` (``formats/heartbeat.HeartbeatRecord``:
  phase starting, then training from the restored step, a beat every interval, the last beat with
  the exit code), replaced atomically; under Slurm by default (OMNI_HEARTBEAT_NODE_DIR, a node-local
  folder, /dev/shm when unset; ``off`` or empty: a file per rank) the beat goes to the node and the rank holding the node's lock copies the node's beats into
  ``<OMNI_HEARTBEAT_DIR>/node-<NODE>.jsonl`` twice per interval, as ``elastic/heartbeat.py`` does
  (the rank's own file only when the node folder is unusable, and for its last beat; a stopped
  leader is taken over by one rank of the node, ``light_relay.Relay.lead``);
- the metrics lines ``<OMNI_METRICS_DIR>/metrics-<stage>-<dp_rank>.jsonl`` (``formats/metrics``; with
  the node folder each line goes there and the leader copies it into ``node-<NODE>.jsonl``, as
  ``elastic/node_metrics.py`` does, but replica 0 of the last stage's, which go straight to its file;
  OMNI_METRICS_PER_NODE=0: every rank's), the life's first line with ``task_started_at``, ``groups_ready_at``, ``restored_at`` and this rank's
  ``restored_step``;
- a checkpoint marker every OMNI_LIGHT_CKPT_EVERY steps (default 5) and at the last step:
  ``<OMNI_CKPT_DIR>/light/rank-<RANK>/step-<N>.json`` (and on a stop signal), those older than
  the step the life restored removed;
- the restore's agreement: every rank sends the steps it holds to rank 0's store at
  MASTER_ADDR:MASTER_PORT (the rendezvous) and all resume from the newest step every rank holds,
  as ``Run.restore`` does with its all-reduce; ranks that hold markers but none in common exit 78
  (a checkpoint that does not fit the job). One connection and one answer per rank; rank 0's store
  listens from rank 0's start (before its cgroup join and set-up; else before it reads its markers), takes
  every connection waiting at each wake-up, reads a
  join as it accepts it and polls only the peers still sending; a rank refused (rank 0 not listening
  yet) backs off from 0.05 to 0.5 s, its jitter drawn each time, instead of retrying every 0.1 s
  (2,000 ranks at 10 tries a second were the machine's load while a 512-node launch started); with
  the node folder, once refused, one rank of the node tries at a time (the holder of
  ``<node folder>/rendezvous-<incarnation>.lock``), backing off to 0.125 s, and the node's other
  refused ranks wait for it to get through and then try at once, so a node's tries cost what one
  rank's did and the last rank refused is at most 0.19 s late instead of 0.75 s. The
  answer carries rank 0's clock, the life's start; rank 0 says on stderr when its store listened and
  had every join (``light rank 0: store listening at T, every join at T (N ranks, W wake-ups)``);
- steps in step: step k of a life is due at the start rank 0 sent + k x OMNI_STEP_DELAY_S, so a
  rank the machine left behind steps at once until it is due again, as a collective keeps real
  ranks together (before, unsynchronised ranks drifted apart by 16 steps at 512 nodes, and the
  scale bench ran out of steps before its last fault); the markers of a life are all kept until
  the next life has agreed;
- exit codes (``elastic/codes.py``): 0 at OMNI_MAX_STEPS, 75 after saving on SIGUSR1 or SIGTERM, 78
  on an environment no restart can fix (with the heartbeat's ``error``), 1 when the rendezvous
  fails.

The run's end, as the scale bench sets it (``OMNI_LIGHT_FINISH_FILE``, a bench control like the
hang's signal, not the runtime's contract): the ranks run with a budget of steps they never reach,
and once the bench has made its last fault's checks it writes a wall-clock time T into that file.
After each step (and once after the restore) a rank tries to read it; from T it takes its last step:
the first step of its life due at or after T, ``agreed + ceil((T - start) / OMNI_STEP_DELAY_S)``,
which every rank of the life computes alike (the same agreed step, rank 0's start, T, the pace), so
all finish at one step, save it and exit 0. A rank reads the file after every step, and no rank is
ahead of the life's clock, so with T at least a step after the file appeared none has passed that
step yet; one that has (a clock moved, a life started after T) ends at its own step, and the bench's
check that every rank finished at one step says so.

A hang, as the scale bench injects it (``BLOCK_SIGNAL``): a real rank's peers block in a collective
that the hung rank never joins, their heartbeat threads still beating. Light ranks have no
collectives, so the bench SIGSTOPs the hung rank and sends SIGURG to every other rank of the step:
from then on they beat every interval but never start another step, as a rank blocked in a
collective does, until they are killed (a stop signal then ends them with exit 1 and no
checkpoint: a rank inside a collective cannot save). SIGURG is ignored by default, so a rank it
reaches before its handler is set is unharmed.

The emulated compute's priority (OMNI_LIGHT_CGROUP, set by the scale bench): the rank moves itself
into that cgroup (``cgroup.procs``), one the bench made with the least CPU weight, so that 2,044 ranks
on one host take only what slurmctld and the supervisor leave, as ranks on their own nodes would.

Between the restore and the end the ranks do not talk to each other (no collectives): a lost node
ends the step through Slurm and the supervisor, as it does for the real trainer.
"""

from __future__ import annotations

# The C modules under socket, signal, select and json: their Python wrappers import enum, re and
# selectors, 1.5 MiB more per process (x 2,048 ranks).
import _json
import _signal
import _socket
import os
import select
import sys
import time

STARTED_AT = time.time()
EXIT_DONE, EXIT_FAILED, EXIT_CHECKPOINTED, EXIT_BAD_INPUT = 0, 1, 75, 78
BLOCK_SIGNAL = _signal.SIGURG
"""The scale bench's hang: this rank's collective never returns from now on (see the module's text)."""
MAX_ERROR_CHARS = 400
BACKOFF_CAP_S = 0.5
"""A rank refused by the store (rank 0 not listening yet) waits at most this long (x1.5, jitter)
before it tries again..."""
PROBE_CAP_S = 0.125
"""...and at most this long when it tries for its whole node (the node's probe: its other ranks wait
on its lock), so that a node's tries cost what one rank's did at BACKOFF_CAP_S."""


class BadInput(Exception):
    """The environment or the checkpoint cannot work: exit 78."""


class Rank:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.rank = _int(env, "RANK", _int(env, "SLURM_PROCID", 0))
        self.world = _int(env, "WORLD_SIZE", 1)
        stages = [s for s in env.get("OMNI_STAGES", "").split(",") if s] or ["main"]
        self.dp = _int(env, "OMNI_DP_SIZE", self.world if len(stages) == 1 else self.world // len(stages))
        colocated = len(stages) == 1
        self.stage = 0 if colocated else _int(env, "OMNI_STAGE", self.rank // max(1, self.dp))
        self.dp_rank = _int(env, "OMNI_DP_RANK", self.rank % max(1, self.dp))
        self.stage_name = "+".join(stages) if colocated else stages[self.stage] if self.stage < len(stages) else "?"
        # replica 0 of the last stage (Layout.reports_loss): its lines go straight to its own file
        self.reports_loss = (colocated or self.stage == len(stages) - 1) and self.dp_rank == 0
        self.per_node = env.get("OMNI_METRICS_PER_NODE", "").strip().lower()
        self.incarnation = _int(env, "OMNI_INCARNATION", _int(env, "SLURM_RESTART_COUNT", 0))
        self.job_id = env.get("OMNI_JOB_ID") or env.get("SLURM_JOB_ID") or "local"
        run_dir = env.get("OMNI_RUN_DIR") or "omni-run"
        self.ckpt_dir = env.get("OMNI_CKPT_DIR") or os.path.join(run_dir, "ckpt")
        self.hb_dir = env.get("OMNI_HEARTBEAT_DIR") or os.path.join(run_dir, "heartbeat")
        self.metrics_dir = env.get("OMNI_METRICS_DIR") or os.path.join(run_dir, "metrics")
        self.interval = _float(env, "OMNI_HEARTBEAT_INTERVAL", 2.0)
        self.step_delay = _float(env, "OMNI_STEP_DELAY_S", 0.1)
        self.max_steps = _int(env, "OMNI_MAX_STEPS", 100)
        self.every = _int(env, "OMNI_LIGHT_CKPT_EVERY", 5)
        self.finish_file = env.get("OMNI_LIGHT_FINISH_FILE", "")
        self.finish_read = False
        """The finish time was read (the module's text): the last step is set."""
        self.master = (env.get("MASTER_ADDR", ""), _int(env, "MASTER_PORT", 0))
        self.node = env.get("SLURMD_NODENAME", "")
        self.mine = os.path.join(self.ckpt_dir, "light", f"rank-{self.rank}")
        self.hb_path = os.path.join(self.hb_dir, f"rank-{self.rank}.json")
        # every key of HeartbeatRecord in its order: the bytes are those the runtime's encode() writes,
        # which the readers take without their slower duplicate-key check (formats.decode)
        self.state: dict[str, object] = {
            "rank": self.rank, "stage": self.stage, "dp_rank": self.dp_rank, "pid": os.getpid(),
            "incarnation": self.incarnation, "job_id": self.job_id[:63], "step": -1, "phase": "starting",
            "time": time.time(), "step_time_s": None, "last_checkpoint_step": None, "beats": 0, "node": self.node,
            "compute_s": None, "data_s": None, "cpu_wait_s": None, "metrics": {}, "error": "", "exit_code": None}
        self.stop_signal = 0
        self.blocked = False
        self.next_beat = 0.0
        self.metrics = None
        self.node_lines = False
        """The node's metrics lines are open: this rank copies them when it leads."""
        self.via_node = False
        """This rank's lines go through the node (not the loss rank's: elastic/node_metrics.py)."""
        self.relay = None
        node_dir = node_dir_setting(env)
        if node_dir and self.node:
            # its own module, imported only here: compiling this script's source costs every rank
            # private memory in proportion to its size (0.4 MiB for the relay), a cached module not
            from light_relay import Relay

            self.relay = Relay.open(node_dir, self.job_id, self.node, self.rank, self.hb_dir,
                                    self.interval)
        self.node_failed = False
        self.start_at = 0.0
        """When the life's steps start (rank 0's clock at the rendezvous): step k is due at
        start_at + k x step_delay, so a rank that fell behind catches up instead of drifting."""
        self.direct_at = 0.0
        """When this rank last wrote its own file while the node's copy may not have that beat."""
        self.store: _socket.socket | None = None
        """Rank 0's store, listening from before its markers are read (the rendezvous)."""
        self.store_at = 0.0

    def check(self) -> None:
        """What the layout checks: the same numbers a real rank would refuse."""
        problems = []
        if self.world < 1 or not 0 <= self.rank < self.world:
            problems.append(f"RANK={self.rank} with WORLD_SIZE={self.world}")
        if self.dp < 1 or not 0 <= self.dp_rank < self.dp:
            problems.append(f"OMNI_DP_RANK={self.dp_rank} with OMNI_DP_SIZE={self.dp}")
        if self.world > 1 and not (self.master[0] and self.master[1]):
            problems.append(f"MASTER_ADDR and MASTER_PORT must be set for WORLD_SIZE={self.world}")
        if self.max_steps < 1 or self.every < 1 or self.interval <= 0:
            problems.append(f"OMNI_MAX_STEPS={self.max_steps}, OMNI_LIGHT_CKPT_EVERY={self.every}, "
                            f"OMNI_HEARTBEAT_INTERVAL={self.interval} (all must be > 0)")
        if self.finish_file and not self.step_delay > 0:
            problems.append(f"OMNI_LIGHT_FINISH_FILE with OMNI_STEP_DELAY_S={self.step_delay} (a finish time "
                            "needs a pace > 0: it names the step due at it)")
        if self.per_node not in ("", "1", "on", "true", "yes", "0", "off", "false", "no"):
            problems.append(f"OMNI_METRICS_PER_NODE={self.per_node[:40]!r} (allowed: 1, on, true, yes or unset: "
                            "per node; 0, off, false, no: each rank's own file)")
        if problems:
            raise BadInput("light rank: couldn't place rank: " + "; ".join(problems))

    # -- files ------------------------------------------------------------------------------------
    def beat(self, *, force: bool = False, last: bool = False, **changes: object) -> None:
        self.state.update(changes)
        now = time.time()
        if not force and now < self.next_beat:
            if self.relay is not None:
                try:
                    self.relay.lead(now)   # the leader publishes twice per interval
                except OSError as e:   # the folder removed under it: its beats go to its own file
                    if not self.node_failed:
                        print(f"light rank: couldn't lead the node's folder: {e}", file=sys.stderr, flush=True)
                    self.node_failed = True
            return
        self.next_beat = now + self.interval
        self.state["beats"] = int(self.state["beats"]) + 1   # type: ignore[call-overload]
        self.state["time"] = now
        data = _dumps(self.state)
        direct = self.relay is None or last
        if self.relay is not None:
            try:
                published = self.relay.beat(data, now, last=last)
            except OSError as e:
                if not self.node_failed:   # once, not every interval
                    print(f"light rank: couldn't beat on the node: {e}", file=sys.stderr, flush=True)
                self.node_failed = True
                published = 0.0
                direct = True   # no rank of the node can relay this beat: its own file
            if self.direct_at and published > self.direct_at and not last:
                self.direct_at = 0.0
                try:
                    os.unlink(self.hb_path)   # the node's copy carries this beat or a newer one
                except OSError:
                    pass
        if not direct:
            return
        try:
            _write_atomic(self.hb_path, data)
            self.direct_at = now
        except OSError as e:   # a flaky shared disk must not end training: the beat goes stale
            print(f"light rank: couldn't write {self.hb_path}: {e}", file=sys.stderr, flush=True)

    def log_metrics(self, step: int, step_time: float | None, **first: float) -> None:
        if self.metrics is None:
            os.makedirs(self.metrics_dir, exist_ok=True)
            path = os.path.join(self.metrics_dir, f"metrics-{self.stage_name}-{self.dp_rank}.jsonl")
            self.metrics = open(path, "ab", buffering=0)  # noqa: SIM115 (closed in finish)
            # lines per node unless OMNI_METRICS_PER_NODE=0 (formats.metrics.per_node_setting), the loss rank's
            # straight to its own file: a lost node costs only other ranks' lines of at most one interval
            self.node_lines = (self.relay is not None and self.per_node not in ("0", "off", "false", "no")
                               and self.relay.open_lines(self.metrics_dir, self.rank, own=not self.reports_loss))
            self.via_node = self.node_lines and not self.reports_loss
        line = {"time": time.time(), "rank": self.rank, "stage": self.stage, "dp_rank": self.dp_rank,
                "incarnation": self.incarnation, "step": step, "step_time_seconds": step_time,
                "data_parallel_size": self.dp, **first}
        if self.via_node:   # per node: the leader copies it into <metrics>/node-<NODE>.jsonl
            self.relay.append_line(_dumps({**line, "file": os.path.basename(self.metrics.name)}))  # type: ignore[union-attr]
        else:
            self.metrics.write(_dumps(line))

    def markers(self) -> list[int]:
        """The steps this rank holds a marker of, oldest first."""
        try:
            return sorted(int(n[5:-5]) for n in os.listdir(self.mine)
                          if n.startswith("step-") and n.endswith(".json") and n[5:-5].isdigit())
        except FileNotFoundError:
            return []

    def prune(self, below: int) -> None:
        """Markers older than the step every rank restored (complete everywhere, so never needed again)."""
        for s in self.markers():
            if s < below:
                try:
                    os.unlink(os.path.join(self.mine, f"step-{s}.json"))
                except FileNotFoundError:
                    pass

    def save(self, step: int) -> None:
        """This rank's marker of ``step``, durable before it counts."""
        self.beat(force=True, phase="checkpointing")
        os.makedirs(self.mine, exist_ok=True)
        _write_atomic(os.path.join(self.mine, f"step-{step}.json"),
                      _dumps({"rank": self.rank, "step": step, "incarnation": self.incarnation, "time": time.time()}),
                      durable=True)
        self.beat(force=True, phase="training", last_checkpoint_step=step)

    def read_finish(self, step: int, agreed: int, start_at: float) -> None:
        """The last step from the finish time, once the file is there (the module's text): the first
        step of this life due at or after it, or ``step`` when that one is past."""
        try:
            fd = os.open(self.finish_file, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            data = os.read(fd, 64)
        finally:
            os.close(fd)
        text = data.decode(errors="replace").strip()
        try:
            at = float(text)
        except ValueError:
            raise BadInput(f"light rank: couldn't read a finish time in {self.finish_file}: {text[:40]!r} is not a "
                           "number (seconds since the epoch)") from None
        if not -1e308 * 10 < at < 1e308 * 10:
            raise BadInput(f"light rank: couldn't read a finish time in {self.finish_file}: {text[:40]!r} is not a "
                           "finite number (seconds since the epoch)")
        due = agreed + int(-((start_at - at) / self.step_delay // 1))   # ceil without importing math
        self.max_steps = min(self.max_steps, max(due, step))
        self.finish_read = True

    # -- the rendezvous: the newest step every rank holds ------------------------------------------
    def agree(self, mine: list[int], timeout_s: float) -> int:
        """The newest step in every rank's ``mine`` (0: none anywhere, a fresh start; -1: ranks hold
        markers but no step in common)."""
        if self.world == 1:
            return max(mine, default=0)
        if self.rank == 0:
            return self._serve(self._listen() if self.store is None else self.store, mine, timeout_s)
        deadline = time.monotonic() + timeout_s
        pause = 0.05
        probe, probe_name, probed, holding, tries = -1, "", False, False, 0
        while True:
            # the first try alone (a rank that starts once the store listens touches no lock); refused,
            # the node's probe (light_relay.Relay.probe_open)
            tries += 1
            if tries > 1 and self.relay is not None and not probed:
                probed = True
                try:
                    probe, probe_name = self.relay.probe_open(self.incarnation)
                except OSError:   # no probe lock: this rank tries alone
                    probe = -1
            if probe >= 0 and not holding:
                holding = self.relay.probe_take(probe)  # type: ignore[union-attr]
                if not holding and not self.relay.probe_free(probe):  # type: ignore[union-attr]
                    if time.monotonic() > deadline:   # another rank of the node tries: wait for it
                        raise ConnectionError(f"couldn't reach the store at {self.master[0]}:{self.master[1]}: timed out")
                    self.beat()
                    time.sleep(0.02)
                    continue
            s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
            try:
                s.settimeout(5)
                s.connect(self.master)
                if probe >= 0:
                    self.relay.probe_done(probe, probe_name, holding=holding)  # type: ignore[union-attr]
                    probe, holding = -1, False
                s.sendall(f"{self.rank} {','.join(map(str, mine)) or '-'}\n".encode())
                s.settimeout(self.interval)
                data = b""
                while not data.endswith(b"\n"):
                    try:
                        chunk = s.recv(64)
                    except TimeoutError:
                        self.beat()
                        if time.monotonic() > deadline:
                            raise
                        continue
                    if not chunk:
                        raise ConnectionError("the store closed the connection")
                    data += chunk
                agreed, _, start = data.partition(b" ")
                self.start_at = float(start) if start.strip() else time.time()
                return int(agreed)
            except OSError as e:   # refused (rank 0 not listening yet), its backlog full, reset: again
                if time.monotonic() > deadline:
                    raise ConnectionError(f"couldn't reach the store at {self.master[0]}:{self.master[1]}: {e}") from e
                self.beat()
                if tries == 1 and self.relay is not None:   # refused alone: to the node's probe at once
                    continue
                # backing off: 2,000 ranks retrying every 0.1 s while rank 0 starts are the machine's
                # whole load at 512 nodes; the jitter drawn anew each time, so that they do not come
                # back together
                time.sleep(pause * (0.5 + int.from_bytes(os.urandom(2), "little") / 65535))
                pause = min(2 * pause, PROBE_CAP_S if probe >= 0 else BACKOFF_CAP_S)
            finally:
                s.close()

    def _listen(self) -> _socket.socket:
        """Rank 0's store, listening from its start (``listen_early``), else before rank 0 reads its
        markers: a rank that starts meanwhile is queued by the kernel, not refused into a back-off."""
        server = listen(*self.master, self.world)
        self.store_at = time.time()
        return server

    def _serve(self, server: _socket.socket, mine: list[int], timeout_s: float) -> int:
        """Every rank's join, then one answer to each. A join is read as its connection is accepted
        (a peer sends it as soon as it is connected) and only the peers whose line is not complete
        yet are polled."""
        poller = select.poll()
        poller.register(server.fileno(), select.POLLIN)
        steps: dict[int, set[int]] = {0: set(mine)}
        peers: dict[int, tuple[_socket.socket, bytes]] = {}
        done: list[_socket.socket] = []
        wakes = 0
        deadline = time.monotonic() + timeout_s
        try:
            while len(steps) < self.world:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"{len(steps)} of {self.world} ranks joined within {timeout_s:.0f}s")
                self.beat()
                ready = [fd for fd, _ in poller.poll(min(self.interval, 0.5) * 1000)]
                if not ready:
                    continue
                wakes += 1
                if server.fileno() in ready:
                    ready.remove(server.fileno())
                    while True:   # every connection waiting, not one per wake-up
                        try:
                            cfd, _addr = server._accept()
                        except BlockingIOError:
                            break
                        conn = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM, 0, cfd)
                        conn.setblocking(False)
                        peers[cfd] = (conn, b"")
                        poller.register(cfd, select.POLLIN)
                        ready.append(cfd)
                for fd in ready:
                    conn, data = peers[fd]
                    try:
                        chunk = conn.recv(4096)
                    except BlockingIOError:
                        continue
                    data += chunk
                    peers[fd] = (conn, data)
                    if not chunk or data.endswith(b"\n"):
                        poller.unregister(fd)
                        del peers[fd]
                        rank, held = data.split()
                        steps[int(rank)] = {int(x) for x in held.split(b",") if x != b"-"}
                        done.append(conn)
            joined_at = time.time()
            common = set.intersection(*steps.values())
            agreed = max(common) if common else -1 if any(steps.values()) else 0
            # the life's start: every rank steps on this clock (a collective keeps real ranks in step)
            self.start_at = time.time()
            answer = f"{agreed} {self.start_at!r}\n".encode()
            for conn in done:
                try:
                    conn.setblocking(True)
                    conn.sendall(answer)
                except OSError:   # that rank is gone: the step ends without this one's help
                    pass
            # what the scale bench splits the rendezvous with (bench/scale_bench.py, STORE_LINE)
            print(f"light rank 0: store listening at {self.store_at!r}, every join at {joined_at!r} "
                  f"({self.world} ranks, {wakes} wake-ups)", file=sys.stderr, flush=True)
            return agreed
        finally:
            for conn in [*done, *(c for c, _ in peers.values())]:
                conn.close()
            server.close()

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> int:
        os.makedirs(self.hb_dir, mode=0o700, exist_ok=True)
        self.beat(force=True)
        self.check()
        if self.rank == 0 and self.world > 1 and self.store is None:
            self.store = self._listen()
        held = self.markers()
        agreed = self.agree(held, _float(self.env, "OMNI_COLLECTIVE_TIMEOUT", 300.0))
        groups_ready_at = time.time()
        if agreed < 0 or (agreed and not os.path.exists(os.path.join(self.mine, f"step-{agreed}.json"))):
            raise BadInput(f"light rank: couldn't restore: no step every rank holds a marker of (rank {self.rank} "
                           f"holds {held[-5:]} in {self.mine})")
        self.prune(agreed)
        step = agreed
        self.beat(force=True, step=step, phase="training", last_checkpoint_step=agreed or None)
        first = {"task_started_at": STARTED_AT, "groups_ready_at": groups_ready_at, "restored_at": time.time(),
                 "restored_step": agreed}
        started = time.time()
        start_at = self.start_at or started
        if self.finish_file:
            self.read_finish(step, agreed, start_at)
        while step < self.max_steps:
            if self.blocked:
                return self._blocked(step)
            self._sleep(start_at + (step + 1 - agreed) * self.step_delay - time.time())
            step += 1
            now = time.time()
            took, started = now - started, now
            self.beat(step=step, step_time_s=took)
            self.log_metrics(step, took, **first)
            first = {}
            if self.finish_file and not self.finish_read:
                self.read_finish(step, agreed, start_at)
            if self.stop_signal:
                self.save(step)
                return self.finish(EXIT_CHECKPOINTED, "stopping")
            if step % self.every == 0 or step == self.max_steps:
                self.save(step)
        return self.finish(EXIT_DONE, "done")

    def _blocked(self, step: int) -> int:
        """In a collective that never returns: beat, never step, until killed or told to stop."""
        while not self.stop_signal:
            time.sleep(self.interval)
            self.beat()
        return self.finish(EXIT_FAILED, "failed", f"stopped at step {step} inside a collective that never returned")

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        wake = self.interval if self.relay is None else self.interval / 2
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, wake))
            self.beat()

    def finish(self, code: int, phase: str, error: str = "") -> int:
        for sig in (_signal.SIGUSR1, _signal.SIGTERM):
            _signal.signal(sig, _signal.SIG_IGN)   # the code is decided
        if error:
            self.state["error"] = " ".join(error.split())[:MAX_ERROR_CHARS]
        self.beat(force=True, last=True, phase=phase, exit_code=code)
        if self.metrics is not None:
            if self.node_lines:
                self.relay.close_lines(self.metrics.fileno())  # type: ignore[union-attr]
            self.metrics.close()
        return code

    def on_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = signum

    def on_block(self, _signum: int, _frame: object) -> None:
        self.blocked = True


def listen(addr: str, port: int, world: int) -> _socket.socket:
    """A non-blocking socket listening on the rendezvous port (all addresses but for the loopback)."""
    server = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    try:
        server.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        server.bind(("" if addr not in ("127.0.0.1", "localhost") else addr, port))
        server.listen(min(world, 4096))
    except OSError:
        server.close()
        raise
    server.setblocking(False)
    return server


def node_dir_setting(env: dict[str, str]) -> str:
    """``formats.heartbeat.node_dir_setting`` without the package: the node-local folder, empty for
    a file per rank."""
    raw = env.get("OMNI_HEARTBEAT_NODE_DIR")
    if raw is None:
        return "/dev/shm" if os.path.isdir("/dev/shm") else ""
    return "" if raw.strip().lower() in ("", "off", "none", "0") else raw


def _int(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise BadInput(f"light rank: couldn't read {name}: {raw[:80]!r} is not an integer") from None


def _float(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        raise BadInput(f"light rank: couldn't read {name}: {raw[:80]!r} is not a number") from None


def _dumps(obj: dict[str, object]) -> bytes:
    """One line of JSON, as ``json.dumps(obj, separators=(",", ":"))`` writes it (without importing
    json and re): str, int, finite float, None, bool and dicts of them."""
    return (_encode(obj) + "\n").encode()


def _encode(value: object) -> str:
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        if not -1e308 * 10 < value < 1e308 * 10:   # NaN and the infinities
            raise ValueError(f"light rank: {value} is no JSON number")
        return _float_text(value)
    if isinstance(value, str):
        return _json.encode_basestring_ascii(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{_json.encode_basestring_ascii(str(k))}:{_encode(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"light rank: can't write {type(value).__name__} as JSON")


def _float_text(value: float) -> str:
    """``repr`` written as msgspec writes it (the runtime's encode): 1.5e-05 as 0.000015, 1e+16 as 1e16."""
    text = repr(value)
    if "e" not in text:
        return text
    mantissa, _, exp = text.partition("e")
    e = int(exp)
    if e < -5 or e > 0:
        return f"{mantissa}e{e}"
    sign, digits = ("-", mantissa[1:]) if mantissa.startswith("-") else ("", mantissa)
    return f"{sign}0.{'0' * (-e - 1)}{digits.replace('.', '')}"


def _write_atomic(path: str, data: bytes, *, durable: bool = False) -> None:
    """Like ``slurm_omni.fsio.write_atomic``: a temporary name in the same folder, then a rename."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def join_cgroup(env: dict[str, str]) -> None:
    """Into OMNI_LIGHT_CGROUP (a cgroup folder), if set: a failure is said once and the rank runs on."""
    folder = env.get("OMNI_LIGHT_CGROUP")
    if folder:
        try:
            with open(os.path.join(folder, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError as e:
            print(f"light rank: couldn't join the cgroup {folder}: {e}", file=sys.stderr, flush=True)


def listen_early(env: dict[str, str]) -> tuple[_socket.socket, float] | None:
    """Rank 0's store as soon as the process runs, before its cgroup join and its set-up (the join
    waits on the kernel for milliseconds, longer while the launch forks), with when it listened; None
    when the environment does not say rank 0 of several, or it cannot listen (``Rank.run`` then opens
    it again and says why)."""
    try:
        rank, world = _int(env, "RANK", _int(env, "SLURM_PROCID", 0)), _int(env, "WORLD_SIZE", 1)
        addr, port = env.get("MASTER_ADDR", ""), _int(env, "MASTER_PORT", 0)
    except BadInput:   # Rank() says what is wrong
        return None
    if rank != 0 or world < 2 or not addr or not 0 < port < 65536:
        return None
    try:
        return listen(addr, port, world), time.time()
    except OSError:
        return None


def main() -> int:
    env = dict(os.environ)
    early = listen_early(env)
    join_cgroup(env)
    try:
        rank = Rank(env)
    except BadInput as e:
        print(e, file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    if early is not None:
        rank.store, rank.store_at = early
    for sig in (_signal.SIGUSR1, _signal.SIGTERM):
        _signal.signal(sig, rank.on_signal)
    _signal.signal(BLOCK_SIGNAL, rank.on_block)
    try:
        return rank.run()
    except BadInput as e:
        print(e, file=sys.stderr, flush=True)
        return rank.finish(EXIT_BAD_INPUT, "failed", str(e))
    except Exception as e:  # noqa: BLE001 (a crash: exit 1, the last beat says why)
        print(f"light rank {rank.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return rank.finish(EXIT_FAILED, "failed", f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main())
