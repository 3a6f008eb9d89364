"""Discrete-event simulation of one long run under one policy, on a given interruption trace.

The job runs from wall time 0. While it runs it trains and checkpoints: every ``ckpt_interval_s``
of training a save blocks for ``ckpt_blocking_s``; a synchronous save is durable when it returns,
an asynchronous one ``ckpt_persist_s`` later (the next save never starts before the previous one
is durable, which ``models.scale`` ensures by keeping the interval >= the persist time).

At an interruption the work since the last durable checkpoint is lost (recomputed later), then the
job is down for detection, resubmission, pending, waiting for a node (when no spare is free and
the policy cannot shrink), job start, restore and the first step; then it runs again. A policy
that shrinks drops one data-parallel replica when no spare is free (its healthy nodes join the
spare pool) and runs at ``replicas / dp`` of full throughput ("running shrunk" is the rest) until
enough nodes are back for a replica, when it grows through a planned restart (synchronous save,
no lost work). Replaced nodes return to the spare pool after ``repair_s``.

A policy that leaves its allocation (every resubmission, and Slurm's requeue) waits in the queue
for ``PolicyCosts.queue_s`` of the event's ``queue_draw`` (a planned grow does not: the larger job
can be submitted while the shrunk one trains).

In-allocation mode (``PolicyCosts.spares`` set, ``simulate_in_allocation``): the allocation holds
``spares`` idle nodes. A lost node is replaced by one of them and the step relaunched inside the
allocation (``relaunch_s``, no queue); a software fault relaunches on the same nodes. Out of spares
the job drops a replica (its healthy nodes serve as the next replacements) while at least
``min_replicas`` are left; below that it is resubmitted (queue wait and a full start) and starts
again full size with all its spares. The cluster's own spare pool does not matter here (the queue
wait stands for finding a whole allocation).

Every wall second lands in exactly one bucket: productive, detection, restart, queue (waiting in
the queue), waiting for nodes, recompute (lost work), checkpoint (blocking), shrunk. Idle spares are
paid as node-seconds; ``spare_s`` expresses them in the job's wall seconds (node-seconds / job
nodes). ETTR = productive / (wall + spare_s): the useful share of what the job paid for.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass

from bench.goodput.failures import Interruption
from bench.goodput.inputs import RunConfig
from bench.goodput.models import PolicyCosts

BUCKETS = ("productive", "detection", "restart", "queue", "waiting", "recompute", "checkpoint", "shrunk")


@dataclass(frozen=True, slots=True)
class Outcome:
    """Seconds per bucket over the whole run, and what happened."""

    policy: str
    wall_s: float
    seconds: dict[str, float]
    interruptions: int
    """Interruptions that hit the running job."""
    absorbed: int
    """Interruptions that arrived while the job was already down (not charged)."""
    shrinks: int
    grows: int
    waits: int
    resubmits: int = 0
    """In-allocation mode: fallbacks to a resubmission (the other policies resubmit every time)."""
    relaunches: int = 0
    """In-allocation mode: relaunches inside the allocation."""
    spare_s: float = 0.0
    """Idle spare node-seconds / job nodes (paid, not used)."""

    @property
    def ettr(self) -> float:
        return self.seconds["productive"] / (self.wall_s + self.spare_s)


class SparePool:
    """Free healthy nodes outside the job; a replaced node comes back after ``repair_s``."""

    def __init__(self, free: int, repair_s: float) -> None:
        self._free = free
        self._returns: list[float] = []
        self.repair_s = repair_s

    def _settle(self, t: float) -> None:
        while self._returns and self._returns[0] <= t:
            heapq.heappop(self._returns)
            self._free += 1

    def free(self, t: float) -> int:
        self._settle(t)
        return self._free

    def broke(self, t: float) -> None:
        heapq.heappush(self._returns, t + self.repair_s)

    def add(self, n: int) -> None:
        self._free += n

    def take(self, n: int, t: float) -> None:
        self._settle(t)
        if self._free < n:
            raise ValueError(f"spare pool: couldn't take {n} nodes at t={t}: {self._free} free")
        self._free -= n

    def when_free(self, n: int, t: float) -> float:
        """Earliest time >= t at which ``n`` nodes are free (inf if never)."""
        self._settle(t)
        if self._free >= n:
            return t
        need = n - self._free
        if len(self._returns) < need:
            return math.inf
        return heapq.nsmallest(need, self._returns)[-1]


def segment(p: PolicyCosts, length: float) -> tuple[float, float, float]:
    """Training, blocking and durable training seconds of a run segment of ``length`` wall s.

    Wall offsets: save k (k >= 1) starts at k x interval + (k - 1) x blocking and covers
    k x interval of training; synchronous saves are durable when they end, async ones
    ``persist`` later."""
    interval, block = p.ckpt_interval_s, p.ckpt_blocking_s
    cycle = interval + block
    n = math.floor(length / cycle + 1e-12)
    rem = max(length - n * cycle, 0.0)
    train = n * interval + min(rem, interval)
    blocking = n * block + max(rem - interval, 0.0)
    if p.ckpt_async:
        durable_saves = max(math.floor((length - p.ckpt_persist_s) / cycle + 1e-12), 0)
    else:
        durable_saves = n
    return train, blocking, min(durable_saves, n) * interval


class _Ledger:
    def __init__(self, wall_s: float) -> None:
        self.wall_s = wall_s
        self.t = 0.0
        self.seconds = dict.fromkeys(BUCKETS, 0.0)

    def charge(self, bucket: str, seconds: float) -> float:
        take = min(max(seconds, 0.0), self.wall_s - self.t)
        self.seconds[bucket] += take
        self.t += take
        return take

    def train(self, p: PolicyCosts, end: float, failed: bool, frac: float) -> float:
        """Train (and checkpoint) from now to ``end``; returns the wall seconds."""
        train, blocking, durable = segment(p, end - self.t)
        lost = train - durable if failed else 0.0
        self.seconds["productive"] += (train - lost) * frac
        self.seconds["recompute"] += lost * frac
        self.seconds["shrunk"] += train * (1 - frac)
        self.seconds["checkpoint"] += blocking
        length = end - self.t
        self.t = end
        return length

    @property
    def over(self) -> bool:
        return self.t >= self.wall_s


def simulate(p: PolicyCosts, run: RunConfig, events: Iterable[Interruption]) -> Outcome:
    if p.spares is not None:
        return simulate_in_allocation(p, run, events)
    wall, dp, per_replica = run.wall_s, run.data_parallel, run.nodes_per_replica
    pool = SparePool(run.spare_nodes, run.repair_s)
    led = _Ledger(wall)
    replicas = dp
    absorbed = hits = shrinks = grows = waits = 0
    queue = iter(sorted(events, key=lambda e: e.time_s))
    ev = next(queue, None)
    while not led.over:
        while ev is not None and ev.time_s < led.t:
            absorbed += 1
            ev = next(queue, None)
        fail_at = ev.time_s if ev is not None else math.inf
        grow_at = pool.when_free(per_replica, led.t) if p.shrink and replicas < dp else math.inf
        end = min(fail_at, grow_at, wall)
        failed = ev is not None and end == fail_at and end < wall
        led.train(p, end, failed, replicas / dp)
        if led.over:
            break
        if not failed:
            pool.take(per_replica, led.t)
            replicas, grows = replicas + 1, grows + 1
            led.charge("restart", p.grow_save_s + p.restart_s)
            continue
        if ev is None:  # narrowed by `failed`; keeps mypy content
            break
        hits += 1
        led.charge("detection", p.detection_s(ev.kind, ev.draw))
        wait = 0.0
        if ev.replace:
            pool.broke(ev.time_s)
            if pool.free(led.t) >= 1:
                pool.take(1, led.t)
            elif p.shrink and replicas > 1:
                replicas, shrinks = replicas - 1, shrinks + 1
                pool.add(per_replica - 1)
            else:
                ready = pool.when_free(1, led.t)
                wait = ready - led.t
                if math.isfinite(ready):
                    pool.take(1, ready)
                waits += 1
        if p.shrink and replicas < dp and pool.free(led.t) >= per_replica:
            pool.take(per_replica, led.t)   # grow inside this restart, at no extra cost
            replicas, grows = replicas + 1, grows + 1
        led.charge("restart", p.resubmit_s + p.pending_s)
        led.charge("queue", p.queue_s(ev.queue_draw))
        led.charge("waiting", wait)
        led.charge("restart", p.start_s + p.restore_s + p.first_step_s)
        ev = next(queue, None)
    while ev is not None:
        absorbed += ev.time_s < wall
        ev = next(queue, None)
    return Outcome(p.name, wall, led.seconds, hits, absorbed, shrinks, grows, waits, resubmits=hits)


def simulate_in_allocation(p: PolicyCosts, run: RunConfig, events: Iterable[Interruption]) -> Outcome:
    """The in-allocation mode (module docstring); ``p.spares`` idle nodes in the allocation."""
    wall, dp, per_replica, nodes = run.wall_s, run.data_parallel, run.nodes_per_replica, run.nodes
    full = p.spares or 0
    led = _Ledger(wall)
    spares, freed, replicas = full, 0, dp
    idle_node_s = 0.0
    absorbed = hits = shrinks = resubmits = relaunches = 0
    queue = iter(sorted(events, key=lambda e: e.time_s))
    ev = next(queue, None)
    while not led.over:
        while ev is not None and ev.time_s < led.t:
            absorbed += 1
            ev = next(queue, None)
        end = min(ev.time_s if ev is not None else math.inf, wall)
        failed = ev is not None and end == ev.time_s and end < wall
        idle_node_s += spares * led.train(p, end, failed, replicas / dp)
        if led.over or ev is None:
            break
        hits += 1
        idle_node_s += spares * led.charge("detection", p.detection_s(ev.kind, ev.draw))
        inside = True
        if ev.replace:   # the lost node leaves the allocation for good
            if freed:
                freed -= 1
            elif spares:
                spares -= 1
            elif replicas - 1 >= p.min_replicas:
                replicas, shrinks = replicas - 1, shrinks + 1
                freed += per_replica - 1
            else:
                inside = False
        if inside:
            relaunches += 1
            idle_node_s += spares * led.charge("restart", p.relaunch_s)
        else:   # a new allocation, full size, all spares again
            resubmits += 1
            led.charge("restart", p.resubmit_s + p.pending_s)
            led.charge("queue", p.queue_s(ev.queue_draw))
            spares, freed, replicas = full, 0, dp
            idle_node_s += spares * led.charge("restart", p.start_s + p.restore_s + p.first_step_s)
        ev = next(queue, None)
    while ev is not None:
        absorbed += ev.time_s < wall
        ev = next(queue, None)
    return Outcome(p.name, wall, led.seconds, hits, absorbed, shrinks, 0, 0, resubmits=resubmits,
                   relaunches=relaunches, spare_s=idle_node_s / nodes)
