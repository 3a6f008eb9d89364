"""Failure confirmation: a pure state machine over timestamped observations.

Level 1 is an infrastructure signal on a node of the job: the node DOWN, FAIL, NOT_RESPONDING or
DRAIN(ED/ING), or a task that exited non-zero or by a signal. Level 2 is progress: a rank is *stale*
when its newest heartbeat is older than ``stale_after`` and the job has *no progress* when the
global step (the highest any rank reported) has not advanced for ``progress_window``; level 2 holds
when some rank is stale and there is no progress.

The rule (evaluated at an injected ``now``; all times in one clock, the manager's):

- CONFIRMED when level 1 and level 2 agree: a level-1 signal names a node on which a stale rank
  runs; when a heartbeat does not name its node, a signal of the same het component agrees (a
  rank whose last heartbeat says phase "failed" counts as a task exit of its component); a node
  NOT_RESPONDING does not agree with its ranks still starting (one cause: the launch starving the
  node's slurmd and the tasks it forked together, ``_one_cause``);
- CONFIRMED as a hang when level 2 alone has held for ``hang_timeout``, once a rank reported a step
  (before it, a start-up that never reaches one is ``startup_timeout_s``'s, below);
- CONFIRMED as stuck when the global step has not advanced for ``stuck_timeout`` although
  heartbeats move (side-thread heartbeats keep beating inside a collective that never returns);
  paused while a rank reports phase checkpointing, stopping or done; before the first step the
  limit is ``startup_timeout_s``;
- CONFIRMED at once when the job's step *ended* with a failure code (``StepEnded``, seen by the
  step supervisor of an in-allocation job when its srun returns): its tasks exited (level 1) and no
  rank of it is left to make progress (level 2), so both levels hold at that moment; a node-state
  signal on a node of the job names the cause;
- CONFIRMED at once when a node of the job is reported failed by the step's own srun ("Node
  failure on N", ``NodeObservation.source == "srun"``) and Slurm's node state shows it DOWN or FAIL
  (``source == "slurm"``): two signals of one failure, so the supervisor need not wait for the
  whole step's teardown (srun kills every task on every node before it ends the step, seconds at
  hundreds of nodes) nor for the ranks' heartbeats to go stale (``corroborate``, on by default);
  srun's report stands for the incarnation: a node read usable afterwards does not end it;
- CONFIRMED at once when a node the step's srun reported failed has every rank that beats from it
  stale (``corroborate``): Slurm's word and the ranks' own silence, two sources, while the job's
  other ranks may still step (no wait for the global step to stop, nor for slurmctld's answer);
- CONFIRMED on level 1 alone only for the kinds the site lists in ``level1_alone`` (none by
  default: a drained node whose ranks still make progress is not a failure of the job);
- SUSPECT when either level holds without the above, NONE otherwise.

A slow step never confirms: while heartbeats move no rank is stale. A rank that stops for a few
step times without any level-1 signal is SUSPECT and returns to NONE when it continues, because
``hang_timeout`` is far above the step time. A rank killed with SIGKILL on a live node confirms
through its task-exit record (level 1) plus its stopped heartbeats (level 2). Once CONFIRMED the
machine latches until ``reset`` (a new incarnation).

Windows are derived from measured times: ``stale_after = max(stale_factor x median heartbeat
interval, stale_floor_s)``, ``progress_window = max(progress_factor x median step time,
progress_floor_s)``, ``hang_timeout = max(hang_factor x median step time, hang_floor_s)``.
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from slurm_omni.errors import ConfigError
from slurm_omni.slurm.types import NodeState

LEVEL1_KINDS = ("down", "fail", "not_responding", "drain", "task_exit")
HARD_KINDS = frozenset({"down", "fail"})
SILENT_CAUSES = frozenset({"hang", "stuck"})
"""Causes confirmed from the ranks' silence alone (level 2): no rank exited, no node was lost."""
"""Node-state kinds that end a step on the node: reported by srun and shown by Slurm, they confirm."""

# The node states that are a level-1 signal, by kind (the manager names a recovery's cause by it too).
NODE_STATE_KIND: dict[NodeState, str] = {
    NodeState.DOWN: "down",
    NodeState.FAIL: "fail",
    NodeState.NOT_RESPONDING: "not_responding",
    NodeState.DRAINED: "drain",
    NodeState.DRAINING: "drain",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ConfirmConfig:
    """Windows of the confirmation rule. Defaults confirm a node loss within about 3 s of the
    fault for steps of 0.2-1 s and heartbeats every 0.5-1 s (5 s with 2 s heartbeats), and never
    confirm a stop of 5 x the median step time alone."""

    stale_factor: float = 2.5
    """A rank is stale after this many median heartbeat intervals without a heartbeat..."""
    stale_floor_s: float = 1.5
    """...and never sooner than this."""
    progress_factor: float = 3.0
    """No progress after this many median step times without a new global step..."""
    progress_floor_s: float = 1.0
    """...and never sooner than this."""
    hang_factor: float = 30.0
    """Level 2 alone confirms (a hang) after this many median step times..."""
    hang_floor_s: float = 30.0
    """...and never sooner than this."""
    stuck_factor: float = 100.0
    """No new global step for this many median step times confirms as stuck even while every
    heartbeat moves (a collective that never returns, with the heartbeat thread alive)..."""
    stuck_floor_s: float = 120.0
    """...and never sooner than this. Paused while a rank reports checkpointing, stopping or done."""
    startup_timeout_s: float = 900.0
    """No first step this long after the first heartbeat confirms as stuck (restore hung)."""
    initial_step_s: float = 1.0
    """Step time assumed until ``min_samples`` steps were measured."""
    initial_heartbeat_s: float = 1.0
    """Heartbeat interval assumed until ``min_samples`` intervals were measured."""
    min_samples: int = 3
    """Measured intervals needed before the measured median replaces the initial value."""
    history: int = 64
    """How many recent step times and heartbeat intervals the medians look at."""
    level1_alone: tuple[str, ...] = ()
    """Level-1 kinds that confirm without level 2 (from: down, fail, not_responding, drain,
    task_exit). Empty by default."""
    corroborate: bool = True
    """A node that the step's srun reported failed and that Slurm's node state shows DOWN or FAIL
    confirms at once (two sources of one failure; only a step supervisor reads srun)."""

    def __post_init__(self) -> None:
        for name in ("stale_factor", "progress_factor", "hang_factor", "stuck_factor"):
            if getattr(self, name) < 1.0:
                raise ConfigError(f"{name} = {getattr(self, name)} must be at least 1")
        for name in ("stale_floor_s", "progress_floor_s", "hang_floor_s", "stuck_floor_s", "startup_timeout_s",
                     "initial_step_s",
                     "initial_heartbeat_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} = {getattr(self, name)} must be positive")
        if self.min_samples < 1 or self.history < self.min_samples:
            raise ConfigError(f"min_samples = {self.min_samples}, history = {self.history}: "
                              "need 1 <= min_samples <= history")
        unknown = sorted(set(self.level1_alone) - set(LEVEL1_KINDS))
        if unknown:
            raise ConfigError(f"level1_alone: unknown kind {unknown[0]!r} "
                              f"(allowed: {', '.join(LEVEL1_KINDS)})")


@dataclass(frozen=True, slots=True)
class NodeObservation:
    """A node of the job seen in a state (from strigger, or the sinfo poll)."""

    time: float
    node: str
    state: NodeState
    reason: str = ""
    source: str = "slurm"
    """"slurm": the node's state as Slurm shows it (strigger, a poll); "srun": the step's srun
    reported the node failed (its state is then DOWN by Slurm's word, read second hand)."""
    asked_at: float | None = None
    """When the read that answered was asked (the state is at least that recent; None: ``time``). A
    usable state ends only the node's Slurm states seen before it was asked (a read asked before a
    DOWN and answered after it says nothing of the node since: 512 emulated nodes, the full poll's
    read in flight for seconds, issue 19), and never srun's report of the node's failure, whenever
    the read was asked: slurmctld tells srun as it takes the node out of the job and kills the
    step's tasks there, so the launch lost them whatever the node shows later, and a usable answer
    right after the report is a read that lags (22.05's ``sinfo`` printed the node ``mixed`` 15 ms
    after the report while ``scontrol`` showed it DOWN: ``slurm/parse_text.py`` SINFO_NODE_LINES)."""


@dataclass(frozen=True, slots=True)
class TaskExit:
    """A task of the job ended (the SPANK fault record); exit 0 without a signal is no fault."""

    time: float
    node: str
    het_offset: int | None      # None: an ordinary job, or unknown
    task_id: int
    exit_code: int | None = None
    signal: int | None = None

    @property
    def faulty(self) -> bool:
        return bool(self.signal) or (self.exit_code is not None and self.exit_code != 0)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One rank's heartbeat: the newest global step it completed, at ``time``."""

    time: float
    rank: int
    global_step: int
    node: str = ""
    het_offset: int | None = None
    phase: str = "training"     # a rank in a phase of QUIET_PHASES may stop beating


@dataclass(frozen=True, slots=True)
class StepEnded:
    """The job's step ended (its srun returned) with ``exit_code``; non-zero: every rank is gone."""

    time: float
    exit_code: int

    @property
    def faulty(self) -> bool:
        return self.exit_code != 0


QUIET_PHASES = frozenset({"done", "stopping"})

Observation = NodeObservation | TaskExit | Heartbeat | StepEnded


class Verdict(enum.Enum):
    NONE = "none"
    SUSPECT = "suspect"
    CONFIRMED = "confirmed"


@dataclass(frozen=True, slots=True)
class Level1Signal:
    kind: str            # one of LEVEL1_KINDS
    node: str
    time: float          # when it was first observed
    het_offset: int | None = None
    detail: str = ""
    source: str = "slurm"
    """Who said it: "slurm" (a node state read from slurmctld), "srun" (the step's srun: a node failure),
    "task" (a task's exit record: srun's or the SPANK plugin's), "step" (the step ended or srun is
    terminating it), "heartbeat" (the rank's last
    beat said failed)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What the confirmation machine concludes at ``at``; the manager journals it as is."""

    verdict: Verdict
    at: float
    cause: str = ""                             # "down", "task_exit", ..., "hang"
    het_offsets: tuple[int, ...] = ()           # affected components
    nodes: tuple[str, ...] = ()                 # affected nodes
    ranks: tuple[int, ...] = ()                 # stale ranks
    first_signal_at: float | None = None        # earliest level-1 signal or level-2 onset involved
    confirmed_at: float | None = None
    last_progress_at: float | None = None       # when the global step last advanced
    fault_at: float | None = None               # best estimate: newest heartbeat of the first stale rank
    reasons: tuple[str, ...] = ()
    signals: tuple[Level1Signal, ...] = ()      # the level-1 signals it rests on, each with its source and time


@dataclass(slots=True)
class _RankState:
    last_time: float
    last_step: int
    node: str
    het_offset: int | None
    phase: str


def _one_cause(signal: Level1Signal, rank: _RankState) -> bool:
    """Is a stale rank's silence the same cause as ``signal``, not a second source: a node's slurmd
    not answering (NOT_RESPONDING) while its rank is still starting (its beats in this launch say
    ``starting``: its task starting, the rendezvous, the restore). The launch's start is what starves
    both: slurmd forking the step's tasks and the tasks it just forked share the node's cores, and
    ranks wait on each other by design then (512 emulated nodes on one host, 08:08: 48 nodes
    NOT_RESPONDING and their starting ranks stale were confirmed a failure 80 s into a relaunch
    nobody had faulted, which then shrank to 1,852 ranks; issue 19). A node that is gone still
    confirms: DOWN or FAIL (srun's report and Slurm's state), its tasks' exits, the step's end, or
    NOT_RESPONDING once its ranks had stepped in this launch."""
    return signal.kind == "not_responding" and rank.phase == "starting"


@dataclass(slots=True)
class Confirmer:
    """Confirmation for one incarnation of one job. ``layout`` maps het offset -> its nodes."""

    config: ConfirmConfig
    layout: Mapping[int, Iterable[str]]
    _node_offsets: dict[str, set[int]] = field(init=False)
    _ranks: dict[int, _RankState] = field(init=False)
    _on_node: dict[str, set[int]] = field(init=False)
    """Node -> the ranks whose newest beat names it: a node srun reported is checked by its own ranks
    (4), not by every rank of the job (2,048 at 512 nodes, every tick until it confirms; issue 19)."""
    _level1: dict[tuple[str, str], Level1Signal] = field(init=False)
    _hard: dict[str, dict[str, Level1Signal]] = field(init=False)
    """node -> source -> its first DOWN or FAIL signal from that source."""
    _step_times: deque[float] = field(init=False)
    _hb_intervals: deque[float] = field(init=False)
    _global_step: int = field(init=False)
    _last_advance: float | None = field(init=False)
    _confirmed: Decision | None = field(init=False)
    _ended: float | None = field(init=False)
    _oldest: float | None = field(init=False)
    """The oldest newest-beat of a rank that may go stale (None: none), kept until a beat changes it:
    evaluated every tick, the rule looks at every rank only when one can be stale (2,048 ranks, issue 19)."""
    _oldest_dirty: bool = field(init=False)
    _beats_seen: float | None = field(init=False)
    """Every beat written before this time has been observed (``beats_seen``); None: judge at the clock."""

    def __post_init__(self) -> None:
        self.reset(self.layout)

    def reset(self, layout: Mapping[int, Iterable[str]]) -> None:
        """Start over for a new incarnation with ``layout``."""
        self.layout = layout
        self._node_offsets = {}
        for offset, nodes in layout.items():
            for node in nodes:
                self._node_offsets.setdefault(node, set()).add(offset)
        self._ranks = {}
        self._on_node = {}
        self._level1 = {}
        self._hard = {}
        self._step_times = deque(maxlen=self.config.history)
        self._hb_intervals = deque(maxlen=self.config.history)
        self._global_step = -1
        self._last_advance = None
        self._confirmed = None
        self._ended = None
        self._oldest = None
        self._oldest_dirty = False
        self._beats_seen = None

    def beats_seen(self, at: float) -> None:
        """Every heartbeat written before ``at`` has been observed (a scan of the folder that started
        then has ended). A poller that reads the beats beside its loop says so after each scan; from
        then on a rank's silence (level 2: stale, no progress, hang, stuck) is judged as of the newest
        such time, never as of a clock that ran on while a scan was still reading: a scan stuck for
        seconds (512 emulated nodes: 14.9 and 17.4 s with no CPU) makes no rank stale. Level 1 is
        judged at the clock. A poller that never says it (the manager, reading in its loop) is judged
        at the clock, as before."""
        if self._beats_seen is None or at > self._beats_seen:
            self._beats_seen = at

    # -- observations -------------------------------------------------------------------------
    def observe(self, obs: Observation) -> None:
        if isinstance(obs, Heartbeat):
            self._heartbeat(obs)
        elif isinstance(obs, StepEnded):
            if obs.faulty and self._ended is None:
                self._ended = obs.time
                self._add_level1(Level1Signal("task_exit", "", obs.time, None, f"step exit code {obs.exit_code}",
                                              source="step"))
        elif isinstance(obs, TaskExit):
            if obs.faulty and obs.node in self._node_offsets:
                how = f"signal {obs.signal}" if obs.signal else f"exit code {obs.exit_code}"
                self._add_level1(Level1Signal("task_exit", obs.node, obs.time, obs.het_offset,
                                              f"task {obs.task_id} {how}", source="task"))
        elif obs.node in self._node_offsets:
            kind = NODE_STATE_KIND.get(obs.state)
            if kind is None:
                if obs.state.usable:   # the node is back: Slurm's states of it seen before the read end
                    self._node_back(obs.node, obs.time if obs.asked_at is None else obs.asked_at)
                return
            signal = Level1Signal(kind, obs.node, obs.time, None, obs.reason, source=obs.source)
            self._add_level1(signal)
            if kind in HARD_KINDS:
                self._hard.setdefault(obs.node, {}).setdefault(obs.source, signal)

    def _node_back(self, node: str, asked: float) -> None:
        """A read asked at ``asked`` shows ``node`` usable: the node-state signals Slurm gave of it
        before then end; srun's report of its failure stands (``NodeObservation.asked_at``)."""
        for key in [k for k, s in self._level1.items()
                    if k[1] == node and k[0] != "task_exit" and s.source != "srun" and s.time <= asked]:
            del self._level1[key]
        hard = {src: s for src, s in self._hard.get(node, {}).items() if src == "srun" or s.time > asked}
        if hard:
            self._hard[node] = hard
            if "srun" in hard:   # its level-1 key may have been Slurm's earlier sighting of the same kind
                self._add_level1(hard["srun"])
        else:
            self._hard.pop(node, None)

    def observe_all(self, observations: Iterable[Observation]) -> None:
        for obs in observations:
            self.observe(obs)

    def _add_level1(self, signal: Level1Signal) -> None:
        # keyed by (kind, node): a node's repeated DOWN reports are one signal
        self._level1.setdefault((signal.kind, signal.node), signal)  # keep the first sighting

    def _heartbeat(self, hb: Heartbeat) -> None:
        prev = self._ranks.get(hb.rank)
        if prev is not None:
            if hb.time <= prev.last_time:
                return   # a re-read or out-of-order file; it says nothing new
            self._hb_intervals.append(hb.time - prev.last_time)
        if prev is None or prev.node != hb.node:
            if prev is not None:
                self._on_node.get(prev.node, set()).discard(hb.rank)
            self._on_node.setdefault(hb.node, set()).add(hb.rank)
        self._ranks[hb.rank] = _RankState(hb.time, hb.global_step, hb.node, hb.het_offset, hb.phase)
        self._oldest_dirty = True
        if hb.phase == "failed":   # the rank's own last word: as good as its task's exit record
            self._level1.setdefault(("rank_failed", f"{hb.node}#{hb.rank}"), Level1Signal(
                "task_exit", hb.node, hb.time, hb.het_offset, f"rank {hb.rank} reported failed", source="heartbeat"))
        if self._last_advance is None:   # the first beat starts the clock of startup progress
            self._last_advance = hb.time
        if hb.global_step > self._global_step:
            if self._last_advance is not None and self._global_step >= 0 and hb.time > self._last_advance:
                per_step = (hb.time - self._last_advance) / (hb.global_step - self._global_step)
                self._step_times.append(per_step)
            self._global_step = hb.global_step
            self._last_advance = max(self._last_advance, hb.time)

    # -- windows ------------------------------------------------------------------------------
    def median_step_s(self) -> float:
        if len(self._step_times) < self.config.min_samples:
            return self.config.initial_step_s
        return statistics.median(self._step_times)

    def median_heartbeat_s(self) -> float:
        if len(self._hb_intervals) < self.config.min_samples:
            return self.config.initial_heartbeat_s
        return statistics.median(self._hb_intervals)

    def stale_after(self) -> float:
        c = self.config
        return max(c.stale_factor * self.median_heartbeat_s(), c.stale_floor_s)

    def progress_window(self) -> float:
        c = self.config
        return max(c.progress_factor * self.median_step_s(), c.progress_floor_s)

    def stuck_timeout(self) -> float:
        c = self.config
        if self._global_step < 0:
            return c.startup_timeout_s
        return max(c.stuck_factor * self.median_step_s(), c.stuck_floor_s)

    def hang_timeout(self) -> float:
        c = self.config
        return max(c.hang_factor * self.median_step_s(), c.hang_floor_s)

    # -- decision -----------------------------------------------------------------------------
    @property
    def latched(self) -> Decision | None:
        """The CONFIRMED decision this incarnation latched, None before: nothing observed after it
        changes it."""
        return self._confirmed

    def evaluate(self, now: float) -> Decision:
        if self._confirmed is not None:
            return self._confirmed
        level1 = [s for s in self._level1.values() if s.time <= now]
        seen = now if self._beats_seen is None else min(now, self._beats_seen)   # level 2's clock
        stale_since = self._stale_since(seen)
        onset = self._level2_onset(stale_since, seen)
        alone = [s for s in level1 if s.kind in self.config.level1_alone]
        if alone:
            return self._confirm(now, alone[0].kind, alone, {}, None,
                                 f"level 1 alone ({alone[0].kind} is in level1_alone)")
        both = [(node, by) for node, by in sorted(self._hard.items())
                if self.config.corroborate and {"srun", "slurm"} <= set(by) and max(x.time for x in by.values()) <= now]
        if both:
            signals = [x for _, by in both for x in by.values()]
            node, by = both[0]
            return self._confirm(now, by["slurm"].kind, signals, {}, None,
                                 f"{node}: the step's srun reported it failed and Slurm shows it "
                                 f"{by['slurm'].kind.upper()}: two sources, no wait for the step's teardown")
        silent = self._silent_reported(seen) if self.config.corroborate else None
        if silent is not None:
            node, signal, ranks = silent
            return self._confirm(now, signal.kind, [signal], ranks, None,
                                 f"{node}: the step's srun reported it failed and its {len(ranks)} rank(s) "
                                 f"stopped beating (stale after {self.stale_after():.1f} s): two sources")
        if self._ended is not None and self._ended <= now:
            gone = {rank: max(r.last_time, self._ended) for rank, r in self._ranks.items()
                    if r.phase not in QUIET_PHASES}
            named = sorted((s for s in level1 if s.node), key=lambda s: (s.kind == "task_exit", s.time))
            first = named[0] if named else min(level1, key=lambda s: s.time)
            return self._confirm(now, first.kind, level1, gone, self._ended,
                                 f"the step ended ({first.kind}{' on ' + first.node if first.node else ''}): "
                                 f"level 1 and level 2 at once")
        if onset is not None:
            stale = [self._ranks[rank] for rank in stale_since]
            agreeing = [s for s in level1 if any(self._agree(s, r) and not _one_cause(s, r) for r in stale)]
            if agreeing:
                first = min(agreeing, key=lambda s: s.time)
                return self._confirm(now, first.kind, agreeing, stale_since, onset,
                                     f"level 1 ({first.kind} on {first.node}) and level 2 agree")
            # a hang is level 2 alone for many step times: before any rank reported a step (every
            # beat "starting", step -1: the launch's tasks start, the rendezvous, the restore) ranks
            # wait on each other by design and no step time exists: a rank silent then is the startup
            # timeout's (stuck), unless level 1 agrees. 512 emulated nodes at load ~2,000: ranks
            # starved 14 s while the launch's last tasks started were confirmed hung 42 s into a
            # 50 s launch (issue 19)
            if self._global_step >= 0 and seen - onset >= self.hang_timeout():
                return self._confirm(now, "hang", [], stale_since, onset,
                                     f"level 2 alone for {seen - onset:.1f} s "
                                     f"(hang timeout {self.hang_timeout():.1f} s)")
        if (self._last_advance is not None and seen - self._last_advance >= self.stuck_timeout()
                and not any(r.phase == "checkpointing" or r.phase in QUIET_PHASES for r in self._ranks.values())):
            return self._confirm(now, "stuck", [], stale_since, onset,
                                 f"no new global step for {seen - self._last_advance:.1f} s "
                                 f"(stuck timeout {self.stuck_timeout():.1f} s)")
        if level1 or onset is not None:
            reasons = [f"level 1: {s.kind} on {s.node}" for s in level1]
            if onset is not None:
                reasons.append(f"level 2 since {onset:.3f}: {len(stale_since)} stale rank(s), "
                               f"no new step for {now - (self._last_advance or now):.1f} s")
            times = [s.time for s in level1] + ([onset] if onset is not None else [])
            return Decision(Verdict.SUSPECT, now, nodes=tuple(sorted({s.node for s in level1})),
                            ranks=tuple(sorted(stale_since)) if onset is not None else (),
                            first_signal_at=min(times), last_progress_at=self._last_advance,
                            reasons=tuple(reasons))
        return Decision(Verdict.NONE, now, last_progress_at=self._last_advance)

    def _silent_reported(self, now: float) -> tuple[str, Level1Signal, dict[int, float]] | None:
        """A node the step's srun reported failed whose every rank (that named it in its beats and did
        not say done or stopping) is stale at ``now``: (node, srun's signal, rank -> stale since). The
        ranks' own silence is the second source; the rest of the job may still step (512 nodes: a
        rule that waited for the whole job to stop confirmed 12.7 s after srun's report, the node's
        ranks stale 1.2 s after it)."""
        limit = self.stale_after()
        for node, by in sorted(self._hard.items()):
            signal = by.get("srun")
            if signal is None or signal.time > now:
                continue
            on_node = [(rank, self._ranks[rank]) for rank in self._on_node.get(node, ())]
            ranks = {rank: r.last_time + limit for rank, r in on_node if r.phase not in QUIET_PHASES}
            if ranks and all(now >= since for since in ranks.values()):
                return node, signal, ranks
        return None

    def _agree(self, signal: Level1Signal, rank: _RankState) -> bool:
        """Does a level-1 signal concern a stale rank: the same node, or (for a heartbeat that does
        not name its node) the same het component, or any node of the job when neither is known."""
        if rank.node and signal.node:
            return rank.node == signal.node
        if rank.het_offset is None:
            return True
        if signal.het_offset is not None:
            return rank.het_offset == signal.het_offset
        return not signal.node or rank.het_offset in self._node_offsets.get(signal.node, set())

    def _stale_since(self, now: float) -> dict[int, float]:
        """Rank -> the time it became stale, for ranks stale at ``now`` (not those that said they
        are done or stopping)."""
        limit = self.stale_after()
        if self._oldest_dirty:
            self._oldest = min((r.last_time for r in self._ranks.values() if r.phase not in QUIET_PHASES), default=None)
            self._oldest_dirty = False
        if self._oldest is None or now - self._oldest < limit:
            return {}
        return {rank: r.last_time + limit for rank, r in self._ranks.items()
                if now - r.last_time >= limit and r.phase not in QUIET_PHASES}

    def _level2_onset(self, stale_since: Mapping[int, float], now: float) -> float | None:
        """When level 2 began, if it holds at ``now``: some rank stale and no new global step."""
        if not stale_since or self._last_advance is None:
            return None
        no_progress_since = self._last_advance + self.progress_window()
        if no_progress_since > now:
            return None
        return max(min(stale_since.values()), no_progress_since)

    def _confirm(self, now: float, cause: str, level1: list[Level1Signal],
                 stale_since: Mapping[int, float], onset: float | None, reason: str) -> Decision:
        offsets: set[int] = set()
        nodes: set[str] = set()
        for s in level1:
            if s.node:
                nodes.add(s.node)
            offsets.update({s.het_offset} if s.het_offset is not None else self._node_offsets.get(s.node, ()))
        if not level1 and not stale_since:   # stuck with every rank beating: the whole job
            offsets.update(self.layout)
        if not level1:   # a hang: the stale ranks say where
            for rank in stale_since:
                r = self._ranks[rank]
                if r.node:
                    nodes.add(r.node)
                offsets.update({r.het_offset} if r.het_offset is not None
                               else self._node_offsets.get(r.node, ()))
        times = [s.time for s in level1] + ([onset] if onset is not None else [])
        fault_at = None
        if stale_since:
            first_rank = min(stale_since, key=lambda k: stale_since[k])
            fault_at = self._ranks[first_rank].last_time
        self._confirmed = Decision(
            Verdict.CONFIRMED, now, cause=cause, het_offsets=tuple(sorted(offsets)),
            nodes=tuple(sorted(nodes)), ranks=tuple(sorted(stale_since)),
            first_signal_at=min(times) if times else now, confirmed_at=now,
            last_progress_at=self._last_advance, fault_at=fault_at, reasons=(reason,),
            signals=tuple(sorted(level1, key=lambda s: s.time)))
        return self._confirmed
