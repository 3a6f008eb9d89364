"""Fail-slow detection: which node keeps the whole job slow, with time passed in.

A data-parallel pipeline runs at the speed of its slowest rank, so a rank's step time says
nothing about who is slow (the fast ranks wait for the slow one inside the step). Each rank's
heartbeat therefore carries its *own* time of the last step: ``compute_s`` (forward, backward,
optimizer, without waits for peers) and ``data_s`` (loading its samples). The detector compares
each node with its peers of the same pipeline stage (stages differ in work, nodes of one stage do
the same work) over a sliding window, with robust statistics:

- a node's level is the median of its ranks' own times (``compute_s + data_s``) in the window; its
  peers' level is the median of the other nodes' samples of that stage, their spread 1.4826 x MAD;
- the node is *slow now* when its level is at least ``1 + margin`` times its peers' and the excess
  is at least ``min_z`` standard errors of the difference of the two medians (the peers' spread x
  1.2533 x sqrt(1/n + 1/m)): a few noisy samples do not count; and the lead is its own doing: it
  is ``1 + margin`` above its own usual level (the median of its last windows), or its peers are
  at theirs (not a peer that sped up: on shared cores a stalled rank's partner gets the CPU);
- SUSPECT from the first evaluation that finds it slow, and while it stays ``1 + margin`` above
  its peers; FLAGGED once that lasted ``sustain_s``; back to OK only after ``clear_s`` below
  ``1 + clear_margin`` (hysteresis);
- the *whole job* is slower when the median own time of all ranks (or the median step time) stayed
  ``job_margin`` above the lowest window median seen for ``sustain_s``, with no node suspect; its cause is data
  when ``data_s`` grew more than ``compute_s``, else compute (a phase of the job, a shared
  slowdown). A whole-job slowdown is reported, never migrated: moving nodes cannot fix it.

``judge_migration`` decides whether a flagged node is worth a planned migration: a replacement
(the step loses at least the node's excess over its peers, and goes back to the job's best window
when that is lower, at most down to the step over the node's ratio), or a shrink of the data
parallelism when that beats keeping k replicas with a slow one (k-1 healthy replicas take k/(k-1)
of the healthy step time), or nothing;
never more than ``max_migrations_per_hour``, and only when the time won over the rest of the run
is ``min_gain`` times the measured cost of a restart. Nothing here is a failure: the confirmation
rule (policy/confirm.py) never sees these verdicts, and a migration is a planned stop that saves
first.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurm_omni.errors import ConfigError

MAD_SCALE = 1.4826   # MAD x this estimates the standard deviation of normal noise
BASELINE_WINDOWS = 10  # a node's usual level: the median over this many windows of its life
FULL_WINDOW = 0.75   # a node's samples must span this share of the window before it is judged
MEDIAN_SE = 1.2533   # a median of n normal samples has sqrt(pi/2) sigma / sqrt(n) standard error


@dataclass(frozen=True, kw_only=True, slots=True)
class FailSlowConfig:
    """Thresholds of the fail-slow detector (the site's ``[failslow]`` table). Defaults measured on
    the embedded cluster (docs/failslow.md): steady and noisy runs never flag, a node 1.3x slower
    is flagged."""

    enabled: bool = True
    """Watch jobs for fail-slow nodes at all."""
    window_s: float = 30.0
    """Sliding window of per-step samples that the medians look at."""
    min_samples: int = 8
    """Samples a node (and its peers) need in the window before it is judged (spanning 3/4 of it)."""
    margin: float = 0.2
    """A node is slow when its median own step time is at least 1 + margin times its peers'..."""
    min_z: float = 4.0
    """...and the excess is at least this many standard errors of the difference of the medians."""
    sustain_s: float = 15.0
    """A slow node is flagged once it stayed slow this long."""
    clear_margin: float = 0.15
    """A flagged node clears only below 1 + clear_margin times its peers'..."""
    clear_s: float = 20.0
    """...held this long (hysteresis)."""
    job_margin: float = 0.25
    """The whole job is slower when its median own (or step) time rose this much over its best window."""
    migrate: bool = True
    """Plan a migration off a flagged node (false: warn only)."""
    max_migrations_per_hour: int = 2
    """At most this many planned migrations per job in any hour."""
    restart_cost_s: float = 30.0
    """What a planned migration costs (save, stop, resubmit, restore), measured."""
    min_gain: float = 2.0
    """Migrate only when the time won over the rest of the run is this many restart costs."""
    count_cpu_wait: bool = False
    """Count a rank's wait for a CPU (``cpu_wait_s``: runnable while another process held the cores)
    as its own time. Off: nodes that share a host's cores (the embedded cluster, oversubscribed
    nodes) are judged by their own work; a SIGSTOPped rank or a slow device still counts. On: a noisy
    neighbour on a node of its own counts too."""

    def __post_init__(self) -> None:
        for name in ("window_s", "sustain_s", "clear_s", "restart_cost_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} = {getattr(self, name)} is not allowed (expected > 0)")
        if self.min_samples < 3:
            raise ConfigError(f"min_samples = {self.min_samples} is not allowed (expected >= 3)")
        for name in ("margin", "job_margin"):
            if not 0 < getattr(self, name) <= 10:
                raise ConfigError(f"{name} = {getattr(self, name)} is not allowed (expected 0 < x <= 10)")
        if not 0 <= self.clear_margin < self.margin:
            raise ConfigError(f"clear_margin = {self.clear_margin} is not allowed (expected "
                              f"0 <= clear_margin < margin = {self.margin})")
        if self.min_z < 0:
            raise ConfigError(f"min_z = {self.min_z} is not allowed (expected >= 0)")
        if self.max_migrations_per_hour < 0:
            raise ConfigError(f"max_migrations_per_hour = {self.max_migrations_per_hour} is not "
                              f"allowed (expected >= 0)")
        if self.min_gain < 1:
            raise ConfigError(f"min_gain = {self.min_gain} is not allowed (expected >= 1)")


@dataclass(frozen=True, slots=True)
class StepSample:
    """One rank's timing of one step, as its heartbeat reported it."""

    time: float
    rank: int
    stage: int
    node: str
    step: int
    compute_s: float
    data_s: float
    step_time_s: float | None = None
    cpu_wait_s: float = 0.0
    """Of ``compute_s + data_s``: waiting for a CPU (run-queue delay)."""

    @property
    def own_s(self) -> float:
        return self.compute_s + self.data_s

    def without_cpu_wait(self) -> StepSample:
        """The rank's own work: its wait for a CPU taken out (from compute first, then data)."""
        wait = min(max(0.0, self.cpu_wait_s), self.own_s)
        compute = max(0.0, self.compute_s - wait)
        data = max(0.0, self.data_s - (wait - (self.compute_s - compute)))
        return StepSample(self.time, self.rank, self.stage, self.node, self.step, compute, data,
                          self.step_time_s, 0.0)


class NodeState(enum.Enum):
    OK = "ok"
    SUSPECT = "suspect"
    FLAGGED = "flagged"


@dataclass(frozen=True, slots=True)
class NodeVerdict:
    node: str
    stage: int
    state: NodeState
    ratio: float          # node's median own time / its peers'
    z: float              # excess in standard errors of the difference of the medians
    level_s: float        # node's median own time
    peer_level_s: float   # peers' median own time
    kind: str             # "compute" or "data": what grew more
    since: float | None   # when it turned SUSPECT (FLAGGED: still the start of the episode)
    samples: int


@dataclass(frozen=True, slots=True)
class JobVerdict:
    slow: bool
    ratio: float          # the larger of own-time and step-time ratios to the best window
    cause: str            # "data", "compute" or "" when not slow
    step_time_s: float | None    # median step time of the window (what the job runs at now)
    best_step_time_s: float | None


@dataclass(frozen=True, slots=True)
class Report:
    time: float
    nodes: tuple[NodeVerdict, ...]
    job: JobVerdict

    @property
    def flagged(self) -> tuple[NodeVerdict, ...]:
        return tuple(v for v in self.nodes if v.state is NodeState.FLAGGED)

    @property
    def summary(self) -> str:
        """One line: what the detector sees."""
        flagged = self.flagged
        if flagged:
            return "; ".join(f"{v.node} (stage {v.stage}) {v.ratio:.2f}x its peers in {v.kind} for "
                             f"{self.time - (v.since or self.time):.0f}s" for v in flagged)
        if self.job.slow:
            return f"whole job {self.job.ratio:.2f}x slower than its best window ({self.job.cause}); no node stands out"
        suspects = [v for v in self.nodes if v.state is NodeState.SUSPECT]
        if suspects:
            return "suspect: " + ", ".join(f"{v.node} {v.ratio:.2f}x" for v in suspects)
        return "no slow node"


def _mad(xs: Sequence[float], center: float) -> float:
    return statistics.median(abs(x - center) for x in xs)


@dataclass
class _Track:
    state: NodeState = NodeState.OK
    since: float | None = None        # start of the slow episode
    clear_since: float | None = None  # FLAGGED and below the clear line since


class FailSlowDetector:
    """Feed ``observe`` with heartbeat samples (duplicates of a rank's step are ignored), call
    ``evaluate(now)``; ``reset`` for a new incarnation (other nodes, other ranks)."""

    def __init__(self, config: FailSlowConfig = FailSlowConfig()) -> None:
        self.config = config
        self._samples: dict[int, deque[StepSample]] = {}
        self._last_step: dict[int, int] = {}
        self._tracks: dict[tuple[int, str], _Track] = {}
        self._best: dict[str, float] = {}
        self._job_since: float | None = None   # the whole job above job_margin since
        self._levels: dict[tuple[int, str], deque[tuple[float, float]]] = {}

    def reset(self) -> None:
        self._job_since = None
        self._levels.clear()
        self._samples.clear()
        self._last_step.clear()
        self._tracks.clear()
        self._best.clear()

    def observe(self, sample: StepSample) -> bool:
        """Take one sample; False when the rank's step was seen already (heartbeats repeat)."""
        if sample.step <= self._last_step.get(sample.rank, -1):
            return False
        self._last_step[sample.rank] = sample.step
        if not self.config.count_cpu_wait and sample.cpu_wait_s > 0:
            sample = sample.without_cpu_wait()
        self._samples.setdefault(sample.rank, deque()).append(sample)
        return True

    def observe_all(self, samples: Iterable[StepSample]) -> None:
        for s in samples:
            self.observe(s)

    def _window(self, now: float) -> list[StepSample]:
        start = now - self.config.window_s
        out: list[StepSample] = []
        for q in self._samples.values():
            while q and q[0].time < start:
                q.popleft()
            out.extend(q)
        return out

    def evaluate(self, now: float) -> Report:
        cfg = self.config
        window = self._window(now)
        by_stage: dict[int, dict[str, list[StepSample]]] = {}
        for s in window:
            by_stage.setdefault(s.stage, {}).setdefault(s.node, []).append(s)
        verdicts: list[NodeVerdict] = []
        for stage, nodes in sorted(by_stage.items()):
            # a node is judged once its samples fill most of the window: the first steps of a life
            # (imports, restore, warm-up) are no baseline
            judged = {n: xs for n, xs in nodes.items() if len(xs) >= cfg.min_samples
                      and max(x.time for x in xs) - min(x.time for x in xs) >= FULL_WINDOW * cfg.window_s}
            baselines = {n: self._baseline(now, stage, n, statistics.median(x.own_s for x in xs))
                         for n, xs in judged.items()}
            for node, xs in sorted(judged.items()):
                peers = [s for n, ys in judged.items() if n != node for s in ys]
                if not peers:
                    continue
                peer_bases = [b for n, b in baselines.items() if n != node and b is not None]
                verdicts.append(self._judge(now, stage, node, xs, peers, baselines[node],
                                            statistics.median(peer_bases) if peer_bases else None))
        return Report(now, tuple(verdicts), self._job(now, window,
                                                      any(v.state is not NodeState.OK for v in verdicts)))

    def _baseline(self, now: float, stage: int, node: str, level: float) -> float | None:
        """The node's usual level in this life: the median of its window levels while it was not
        suspect, one kept per fifth of a window (the last ``BASELINE_WINDOWS`` windows); None until
        three are kept."""
        hist = self._levels.setdefault((stage, node), deque(maxlen=5 * BASELINE_WINDOWS))
        track = self._tracks.get((stage, node))
        calm = track is None or track.state is NodeState.OK   # an episode is not the usual level
        if calm and (not hist or now - hist[-1][0] >= self.config.window_s / 5):
            hist.append((now, level))
        return statistics.median(v for _, v in hist) if len(hist) >= 3 else None

    def _judge(self, now: float, stage: int, node: str, xs: list[StepSample], peers: list[StepSample],
               baseline: float | None, peer_baseline: float | None) -> NodeVerdict:
        cfg = self.config
        own = [s.own_s for s in xs]
        peer_own = [s.own_s for s in peers]
        level, peer_level = statistics.median(own), statistics.median(peer_own)
        spread = max(MAD_SCALE * _mad(peer_own, peer_level), 0.01 * peer_level, 1e-6)
        # the standard error of a difference of two medians of n and m samples of that spread
        se = MEDIAN_SE * spread * math.sqrt(1 / len(own) + 1 / len(peer_own))
        ratio = level / peer_level if peer_level > 0 else 1.0
        z = (level - peer_level) / se
        d_compute = statistics.median(s.compute_s for s in xs) - statistics.median(s.compute_s for s in peers)
        d_data = statistics.median(s.data_s for s in xs) - statistics.median(s.data_s for s in peers)
        kind = "data" if d_data > d_compute else "compute"
        # peer-relative against job-relative: ahead of its peers because they sped up (on shared cores
        # a stalled rank's partner gets the CPU) is not slow; slower than its own usual level, or than
        # peers at their usual level, is
        peers_faster = peer_baseline is not None and peer_level < peer_baseline / (1 + cfg.margin)
        got_slower = baseline is not None and level >= (1 + cfg.margin) * baseline
        slow = ratio >= 1 + cfg.margin and z >= cfg.min_z and (got_slower or not peers_faster)
        track = self._tracks.setdefault((stage, node), _Track())
        if track.state is NodeState.FLAGGED:
            if ratio < 1 + cfg.clear_margin:
                track.clear_since = now if track.clear_since is None else track.clear_since
                if now - track.clear_since >= cfg.clear_s:
                    track.state, track.since, track.clear_since = NodeState.OK, None, None
            else:
                track.clear_since = None
        elif slow or (track.state is NodeState.SUSPECT and ratio >= 1 + cfg.margin):
            # the z test opens an episode; the margin alone keeps it open (a window's z wavers)
            track.since = now if track.since is None else track.since
            track.state = NodeState.FLAGGED if now - track.since >= cfg.sustain_s else NodeState.SUSPECT
        else:
            track.state, track.since = NodeState.OK, None
        return NodeVerdict(node, stage, track.state, ratio, z, level, peer_level, kind, track.since, len(xs))

    def _job(self, now: float, window: list[StepSample], node_slow: bool) -> JobVerdict:
        cfg = self.config
        ranks = {s.rank for s in window}
        if not ranks or len(window) < cfg.min_samples * len(ranks):
            return JobVerdict(False, 1.0, "", None, self._best.get("step"))
        levels = {"own": statistics.median(s.own_s for s in window),
                  "compute": statistics.median(s.compute_s for s in window),
                  "data": statistics.median(s.data_s for s in window)}
        steps = [s.step_time_s for s in window if s.step_time_s is not None]
        if steps:
            levels["step"] = statistics.median(steps)
        # the best window as one snapshot (its compute and data together), so that the cause of a
        # slowdown compares like with like
        if not self._best or levels["own"] < self._best["own"]:
            self._best = {**self._best, "own": levels["own"], "compute": levels["compute"], "data": levels["data"]}
        if "step" in levels:
            self._best["step"] = min(self._best.get("step", levels["step"]), levels["step"])
        ratios = [levels[k] / self._best[k] for k in ("own", "step") if k in levels and self._best.get(k, 0) > 0]
        ratio = max(ratios, default=1.0)
        above = ratio >= 1 + cfg.job_margin and not node_slow
        self._job_since = (now if self._job_since is None else self._job_since) if above else None
        slow = self._job_since is not None and now - self._job_since >= cfg.sustain_s
        cause = ""
        if slow:
            cause = "data" if levels["data"] - self._best["data"] > levels["compute"] - self._best["compute"] else "compute"
        return JobVerdict(slow, ratio, cause, levels.get("step"), self._best.get("step"))


# -- the decision to migrate ---------------------------------------------------------------------

class Mitigation(enum.Enum):
    NONE = "none"          # nothing flagged
    WARN = "warn"          # flagged, but a migration does not pay (or is capped, or disabled)
    REPLACE = "replace"    # a spare takes the slow node's place
    SHRINK = "shrink"      # the replica with the slow node is dropped


@dataclass(frozen=True, slots=True)
class Estimate:
    """Step times the decision compared (seconds per step) and what the rest of the run wins."""

    step_now_s: float
    step_replace_s: float
    step_shrink_s: float | None
    remaining_steps: int
    gain_replace_s: float
    gain_shrink_s: float | None
    restart_cost_s: float


@dataclass(frozen=True, slots=True)
class MigrationDecision:
    action: Mitigation
    node: str
    reasons: tuple[str, ...]
    estimate: Estimate | None = None


@dataclass(frozen=True, slots=True)
class MigrationBudget:
    """When this job's planned migrations happened (the manager's clock), for the hourly cap."""

    times: tuple[float, ...] = ()

    def used(self, now: float) -> int:
        return sum(1 for t in self.times if now - t < 3600.0)

    def add(self, now: float) -> MigrationBudget:
        return MigrationBudget(tuple(t for t in self.times if now - t < 3600.0) + (now,))


def estimate(verdict: NodeVerdict, step_now_s: float, replicas: int, remaining_steps: int,
             restart_cost_s: float, best_step_s: float | None = None) -> Estimate:
    """The step after a replacement. The step loses at least the node's own excess over its peers:
    measured in the same window, so a change of the machine's other load moves both alike (every
    step ends in collectives over all ranks: the slow rank's own time is on the step's path). A slow
    rank holds its peers up by more than that (they wait for its sends too), so when the job's best
    window is known the step goes back to it, but never below the step scaled down by the node's
    ratio (the slow node cannot have cost more than that). The best window alone is no floor: it
    compares windows, and where the other load dropped as the node slowed (shared cores) the job's
    step stood at its best while one node ran twice its peers' time (the 26.05 lane, 2026-12-01:
    "a replacement would win -1s"). After a shrink each of k-1 healthy replicas carries k/(k-1) of
    the work."""
    step_excess = step_now_s - max(0.0, verdict.level_s - verdict.peer_level_s)
    if best_step_s is not None and best_step_s > 0:
        step_replace = min(max(best_step_s, step_now_s / max(verdict.ratio, 1.0)), step_excess)
    else:
        step_replace = step_excess
    step_replace = min(max(step_replace, 1e-9), step_now_s)
    step_shrink = step_replace * replicas / (replicas - 1) if replicas > 1 else None
    gain_shrink = None if step_shrink is None else remaining_steps * (step_now_s - step_shrink) - restart_cost_s
    return Estimate(step_now_s, step_replace, step_shrink, remaining_steps,
                    remaining_steps * (step_now_s - step_replace) - restart_cost_s, gain_shrink, restart_cost_s)


def first_flagged(report: Report) -> NodeVerdict:
    """The flagged node whose episode began first (then the slowest): a slow rank makes its pipeline
    partners' times waver too, and the node that started it was slow first."""
    return min(report.flagged, key=lambda v: (v.since if v.since is not None else report.time, -v.ratio))


def judge_migration(report: Report, *, config: FailSlowConfig, replicas: int, remaining_steps: int,
                    spare_available: bool, can_shrink: bool, budget: MigrationBudget, now: float) -> MigrationDecision:
    """Replace, shrink, warn or nothing for the first flagged node of ``report``."""
    if not report.flagged:
        return MigrationDecision(Mitigation.NONE, "", (report.summary,))
    v = first_flagged(report)
    why = [f"{v.node} (stage {v.stage}) runs {v.ratio:.2f}x its peers' own step time ({v.kind})"]
    if not config.migrate:
        return MigrationDecision(Mitigation.WARN, v.node, (*why, "failslow.migrate is false: warning only"))
    if budget.used(now) >= config.max_migrations_per_hour:
        return MigrationDecision(Mitigation.WARN, v.node, (*why, (f"{budget.used(now)} migration(s) in the last "
                                 f"hour: the cap is {config.max_migrations_per_hour}")))
    step_now = report.job.step_time_s
    if step_now is None:
        return MigrationDecision(Mitigation.WARN, v.node, (*why, "no step time measured yet"))
    est = estimate(v, step_now, replicas, remaining_steps, config.restart_cost_s, report.job.best_step_time_s)
    need = (config.min_gain - 1.0) * config.restart_cost_s
    if spare_available:
        if est.gain_replace_s >= need:
            return MigrationDecision(Mitigation.REPLACE, v.node, (*why, (f"a spare wins {est.gain_replace_s:.0f}s "
                                     f"over {remaining_steps} steps after a {config.restart_cost_s:.0f}s restart")), est)
        return MigrationDecision(Mitigation.WARN, v.node, (*why, (f"a replacement would win {est.gain_replace_s:.0f}s "
                                 f"(needs {need:.0f}s): keep running")), est)
    if can_shrink and est.gain_shrink_s is not None and est.gain_shrink_s >= need:
        return MigrationDecision(Mitigation.SHRINK, v.node, (*why, (f"no spare; {replicas - 1} healthy replicas "
                                 f"({est.step_shrink_s:.3f}s/step) beat {replicas} with a slow one "
                                 f"({step_now:.3f}s/step)")), est)
    return MigrationDecision(Mitigation.WARN, v.node, (*why, "no spare, and a shrink does not beat the slow node"
                             if can_shrink else "no spare and no shrink possible"), est)


def samples_from(records: Iterable[Mapping[str, Any]]) -> list[StepSample]:
    """Samples from heartbeat-like dicts (recorded fixtures); records without ``compute_s`` are skipped."""
    out = []
    for r in records:
        compute, data = r.get("compute_s"), r.get("data_s")
        if not isinstance(compute, (int, float)) or not isinstance(data, (int, float)):
            continue
        step_time, wait = r.get("step_time_s"), r.get("cpu_wait_s")
        out.append(StepSample(float(r["time"]), int(r["rank"]), int(r["stage"]), str(r.get("node", "")),
                              int(r["step"]), float(compute), float(data),
                              float(step_time) if isinstance(step_time, (int, float)) else None,
                              float(wait) if isinstance(wait, (int, float)) else 0.0))
    return out


@dataclass(frozen=True, slots=True)
class Replay:
    """A recorded series run through the detector: every report, and when a node was first flagged."""

    reports: tuple[Report, ...] = field(default_factory=tuple)
    first_flag: Mapping[str, float] = field(default_factory=dict)
    job_slow_at: float | None = None


def replay(samples: Sequence[StepSample], config: FailSlowConfig, *, every_s: float = 1.0) -> Replay:
    """Feed ``samples`` in time order and evaluate every ``every_s`` of their own clock."""
    det = FailSlowDetector(config)
    ordered = sorted(samples, key=lambda s: s.time)
    if not ordered:
        return Replay()
    reports: list[Report] = []
    first: dict[str, float] = {}
    job_slow_at: float | None = None
    t = ordered[0].time
    i = 0
    while i < len(ordered):
        t += every_s
        while i < len(ordered) and ordered[i].time <= t:
            det.observe(ordered[i])
            i += 1
        rep = det.evaluate(t)
        reports.append(rep)
        for v in rep.flagged:
            first.setdefault(v.node, t)
        if rep.job.slow and job_slow_at is None:
            job_slow_at = t
    return Replay(tuple(reports), first, job_slow_at)
