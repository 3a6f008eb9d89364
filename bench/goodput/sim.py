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
wait stands for finding a whole allocation). Every healthy node held and not running (a spare, the
rest of a dropped replica, a pool node not yet used) is paid as idle. With ``batch_host`` the
supervisor runs in the batch script: a lost node is the batch host with probability 1 / nodes held
(the event's ``host_draw``), and then the allocation ends (a resubmission).

Pools (``PolicyCosts.pools``; issue 20, the control plane outside the allocations): whenever a
relaunch leaves the job running shrunk, it asks for a pool allocation of the nodes missing to the
full size (spares included) that no pending pool brings already. The pool starts
``pool_wait_s(pool_draw)`` later: the queue-wait model, never longer than a failed node's return to
service (``repair_s``). When it starts, its nodes are held (paid), and a planned relaunch (a
synchronous save, no lost work: ``grow``) grows the job back to as many replicas as the idle nodes
complete; a pool that starts while the job is down joins that relaunch at no cost. Training goes
on, shrunk, while a pool waits; more losses meanwhile use the idle nodes, then shrink again and ask
for more. A resubmission cancels the pending pools.

Time limit (``time_limit_s``): the allocation ends that long after it began. Without a successor
(``successor_lead_s`` None) the job saves, is resubmitted and waits in the queue; with one, the
successor is requested ``successor_lead_s`` before the limit and its queue wait (``limit_draws``)
starts then: when it starts before the limit the job hands over to it at once (the old allocation
is released), else the job stops at the limit and waits for it. A handover is a planned save and a
fresh start on new nodes (start, restore, first step: ``handover``) with the full size and all
spares; pending pools are released with the old allocation (pools have no limit of their own here).

Memory tier (``PolicyCosts.files_interval_s`` set): ``ckpt_interval_s`` is then the memory snapshots',
and a relaunch inside the allocation restores from memory (the work since the last memory snapshot is
lost); a new allocation (a resubmission, the batch host lost) finds no memory of the job and goes back to
the newest file system checkpoint, taken every ``files_interval_s`` of training (by step number, as the
runtime does, across relaunches), or a planned save's: the rest of the work since is lost too.

Every wall second lands in exactly one bucket: productive, detection, restart, restore, queue
(waiting in the queue), waiting for nodes, recompute (lost work), checkpoint (blocking), shrunk,
grow (the planned relaunch of a grow-back), handover (a new allocation after a time limit). Idle
nodes are paid as node-seconds; ``spare_s`` expresses them in the job's wall seconds (node-seconds /
job nodes). ETTR = productive / (wall + spare_s): the useful share of what the job paid for.

Not modelled: where a pool's nodes sit (a node on another leaf switch may slow the collectives), a
pool's own failures beyond the Poisson trace of the job's nodes, and the supervisor's own host (its
loss costs one relaunch by design, issue 20; not in the trace).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.goodput.failures import Interruption
from bench.goodput.inputs import RunConfig
from bench.goodput.models import PolicyCosts

BUCKETS = ("productive", "detection", "restart", "restore", "queue", "waiting", "recompute", "checkpoint", "shrunk",
           "grow", "handover")


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
    pools: int = 0
    """In-allocation mode with pools: pool allocations requested."""
    host_losses: int = 0
    """In-allocation mode: losses of the batch host that ended the allocation."""
    handovers: int = 0
    """In-allocation mode: allocations ended by their time limit (or a successor started early)."""

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

    def relose(self, seconds: float, frac: float) -> None:
        """Work counted as productive that a restore from an older checkpoint takes back."""
        self.seconds["productive"] -= seconds * frac
        self.seconds["recompute"] += seconds * frac

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


def simulate(p: PolicyCosts, run: RunConfig, events: Iterable[Interruption],
             limit_draws: Sequence[float] = ()) -> Outcome:
    if p.spares is not None:
        return simulate_in_allocation(p, run, events, limit_draws)
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
        led.charge("restart", p.start_s)
        led.charge("restore", p.restore_s)
        led.charge("restart", p.first_step_s)
        ev = next(queue, None)
    while ev is not None:
        absorbed += ev.time_s < wall
        ev = next(queue, None)
    return Outcome(p.name, wall, led.seconds, hits, absorbed, shrinks, grows, waits, resubmits=hits)


class _Allocation:
    """The in-allocation mode's state: replicas running, healthy nodes held idle (spares, the
    healthy rest of a dropped replica, pool nodes not yet used), pending pool allocations, and the
    idle node-seconds paid."""

    def __init__(self, p: PolicyCosts, run: RunConfig) -> None:
        self.p, self.dp, self.per = p, run.data_parallel, run.nodes_per_replica
        self.full = p.spares or 0
        self.replicas, self.idle = self.dp, self.full
        self.pools: list[tuple[float, int]] = []
        self.idle_node_s = 0.0
        self.requested = 0

    def pay(self, seconds: float) -> None:
        self.idle_node_s += self.idle * seconds

    def reset(self) -> None:
        """A new allocation of the full size: spares again, pending pools cancelled."""
        self.replicas, self.idle, self.pools = self.dp, self.full, []

    def request(self, t: float, draw: float) -> None:
        """Running shrunk: ask for the nodes missing to the full size (spares included) that no
        pending pool brings already."""
        if not self.p.pools or self.replicas >= self.dp:
            return
        need = (self.dp - self.replicas) * self.per + self.full - self.idle - sum(n for _, n in self.pools)
        if need > 0:
            self.pools.append((t + self.p.pool_wait_s(draw), need))
            self.requested += 1

    def next_pool(self) -> float:
        return min((start for start, _ in self.pools), default=math.inf)

    def settle(self, t: float) -> None:
        """Pools started by ``t`` join the idle nodes (paid from their start)."""
        for start, n in [x for x in self.pools if x[0] <= t]:
            self.pools.remove((start, n))
            self.idle += n
            self.idle_node_s += n * (t - start)

    def grow(self) -> int:
        """Replicas the idle nodes complete, up to the full data-parallel size."""
        k = min(self.dp - self.replicas, self.idle // self.per)
        self.replicas += k
        self.idle -= k * self.per
        return k


def simulate_in_allocation(p: PolicyCosts, run: RunConfig, events: Iterable[Interruption],
                           limit_draws: Sequence[float] = ()) -> Outcome:
    """The in-allocation mode (module docstring); ``p.spares`` idle nodes in the allocation.

    ``limit_draws``: queue-wait draws of the allocations after each time limit, in order (the
    median once they run out)."""
    wall, nodes = run.wall_s, run.nodes
    led = _Ledger(wall)
    a = _Allocation(p, run)
    absorbed = hits = shrinks = resubmits = relaunches = grows = host_losses = handovers = 0
    draws = iter(limit_draws)
    queue = iter(sorted(events, key=lambda e: e.time_s))
    ev = next(queue, None)
    waits: list[float] = []

    def new_allocation(now: float) -> float:
        """When the allocation that starts at ``now`` hands over to the next one (inf: never); the
        next one's queue wait is drawn here and kept in ``waits``."""
        waits.clear()
        if p.time_limit_s <= 0:
            return math.inf
        limit = now + p.time_limit_s
        waits.append(p.queue_s(next(draws, 0.5)))
        if p.successor_lead_s is None:
            return limit
        return min(limit, limit - p.successor_lead_s + waits[0])

    handover_at = new_allocation(0.0)
    alloc_end = p.time_limit_s if p.time_limit_s > 0 else math.inf
    progress = 0.0   # training seconds the job's newest checkpoint holds (in memory, with the memory tier)
    on_files = 0.0   # ... its newest planned save on the file system
    while not led.over:
        while ev is not None and ev.time_s < led.t:
            absorbed += 1
            ev = next(queue, None)
        fail_at = ev.time_s if ev is not None else math.inf
        pool_at = a.next_pool()
        end = min(fail_at, pool_at, handover_at, wall)
        failed = ev is not None and end == fail_at and end < wall
        frac = a.replicas / a.dp
        trained, _, durable = segment(p, max(end - led.t, 0.0))
        progress += durable if failed else trained
        a.pay(led.train(p, end, failed, frac))
        if led.over:
            break
        if not failed:   # a planned save (a handover's, a grow's) is on the file system
            on_files = progress
        if not failed and end == handover_at:   # the time limit, or the successor started before it
            handovers += 1
            led.charge("checkpoint", p.grow_save_s)   # a planned save: nothing lost
            if p.successor_lead_s is None:
                led.charge("handover", p.resubmit_s + p.pending_s)
                led.charge("queue", waits[0])
            else:   # the successor waited past the limit: the job waits for it
                led.charge("queue", max(0.0, (alloc_end - p.successor_lead_s + waits[0]) - led.t))
            a.reset()
            began = led.t
            handover_at, alloc_end = new_allocation(began), began + p.time_limit_s
            a.pay(led.charge("handover", p.start_s + p.restore_s + p.first_step_s))
            continue
        if not failed:   # a pool allocation started: a planned relaunch grows the job back
            a.settle(led.t)
            if a.replicas < a.dp and a.idle >= a.per:
                a.pay(led.charge("grow", p.grow_save_s + p.relaunch_s + p.relaunch_restore_s))
                grows += a.grow() > 0
            continue
        if ev is None:  # narrowed by `failed`; keeps mypy content
            break
        hits += 1
        a.pay(led.charge("detection", p.detection_s(ev.kind, ev.draw)))
        inside = True
        if ev.replace:   # the lost node leaves the allocation for good
            held = a.replicas * a.per + a.idle
            if p.batch_host and ev.host_draw * held < 1:   # the batch host: the allocation ends
                inside, host_losses = False, host_losses + 1
            elif a.idle:
                a.idle -= 1
            elif a.replicas - 1 >= p.min_replicas:
                a.replicas, shrinks = a.replicas - 1, shrinks + 1
                a.idle += a.per - 1
            else:
                inside = False
        if inside:
            relaunches += 1
            a.settle(led.t)
            grows += a.grow() > 0          # pool nodes already there join this relaunch at no cost
            a.request(led.t, ev.pool_draw)
            a.pay(led.charge("restart", p.relaunch_s))
            a.pay(led.charge("restore", p.relaunch_restore_s))
        else:   # a new allocation, full size, all spares again
            resubmits += 1
            if p.files_interval_s is not None:   # its memory is gone: back to the file system's newest
                newest = max(on_files, math.floor(progress / p.files_interval_s + 1e-9) * p.files_interval_s)
                led.relose(progress - newest, frac)
                progress = on_files = newest
            led.charge("restart", p.resubmit_s + p.pending_s)
            led.charge("queue", p.queue_s(ev.queue_draw))
            a.reset()
            began = led.t
            handover_at = new_allocation(began)
            alloc_end = began + p.time_limit_s if p.time_limit_s > 0 else math.inf
            a.pay(led.charge("restart", p.start_s + p.first_step_s))
            a.pay(led.charge("restore", p.restore_s))
        ev = next(queue, None)
    while ev is not None:
        absorbed += ev.time_s < wall
        ev = next(queue, None)
    return Outcome(p.name, wall, led.seconds, hits, absorbed, shrinks, grows, 0, resubmits=resubmits,
                   relaunches=relaunches, spare_s=a.idle_node_s / nodes, pools=a.requested,
                   host_losses=host_losses, handovers=handovers)
