"""The interruption process of the large run: categories, how each one shows itself, the trace.

Categories and counts are the 419 unexpected interruptions of the Llama 3 405B pre-training run
(16,384 H100, 54 days; "The Llama 3 Herd of Models", 2024, table 5). The paper prints 30.1 % next
to "Faulty GPU" although 148 / 419 is 35.3 %; the counts add up to 419 and the other percentages
match them, so the counts are the weights here.

How a category shows itself decides who can see it and when:

- ``node_down``: the host goes away (power, chassis, CPU, memory, planned-looking maintenance).
  slurmd stops answering; Slurm marks the node DOWN after SlurmdTimeout.
- ``task_crash``: a process dies on a host that stays up (an Xid on the GPU, an uncorrectable HBM
  error, a software bug). The peers block in their next collective until NCCL's watchdog aborts.
- ``hang``: ranks stop making progress without exiting (a switch or cable, a NIC, a stuck GPU
  system processor, NCCL timeouts of unknown cause). Nothing exits until a timeout fires.

``replace`` says whether the job must leave a node (hardware) or can restart in place (software).
The mapping is ours, from the component names; it is the simplest reading, not the paper's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

Kind = Literal["node_down", "task_crash", "hang"]
KINDS: tuple[Kind, ...] = ("node_down", "task_crash", "hang")


@dataclass(frozen=True, slots=True)
class Category:
    name: str
    count: int
    kind: Kind
    replace: bool


LLAMA3_CATEGORIES: tuple[Category, ...] = (
    Category("Faulty GPU", 148, "task_crash", True),
    Category("GPU HBM3 Memory", 72, "task_crash", True),
    Category("Software Bug", 54, "task_crash", False),
    Category("Network Switch/Cable", 35, "hang", True),
    Category("Host Maintenance", 32, "node_down", True),
    Category("GPU SRAM Memory", 19, "task_crash", True),
    Category("GPU System Processor", 17, "hang", True),
    Category("NIC", 7, "hang", True),
    Category("NCCL Watchdog Timeouts", 7, "hang", False),
    Category("Silent Data Corruption", 6, "task_crash", True),
    Category("GPU Thermal Interface + Sensor", 6, "task_crash", True),
    Category("SSD", 3, "node_down", True),
    Category("Power Supply", 3, "node_down", True),
    Category("Server Chassis", 2, "node_down", True),
    Category("IO Expansion Board", 2, "node_down", True),
    Category("Dependency", 2, "task_crash", False),
    Category("CPU", 2, "node_down", True),
    Category("System Memory", 2, "node_down", True),
)


@dataclass(frozen=True, slots=True)
class Interruption:
    """One unexpected interruption at wall time ``time_s`` (seconds from the start of the run).

    ``draw`` is a uniform [0, 1) number of the event itself, used by policies whose reaction time
    varies (a person's response, the phase of Slurm's node ping); drawing it with the trace keeps
    the three policies on exactly the same events (common random numbers). ``queue_draw``, drawn
    from a stream of its own (so the trace is the same with or without it), places the event's
    queue wait in the queue-wait distribution (``models.PolicyCosts.queue_s``). ``pool_draw`` places
    the wait of a pool allocation requested at this event in the same distribution, and
    ``host_draw`` says which node a lost node was (the batch host when below 1 / nodes held); each
    has a stream of its own too."""

    time_s: float
    category: str
    kind: Kind
    replace: bool
    draw: float
    queue_draw: float = 0.5
    pool_draw: float = 0.5
    host_draw: float = 0.5


def interruption_trace(*, wall_s: float, expected: float, seed: int,
                       categories: tuple[Category, ...] = LLAMA3_CATEGORIES) -> list[Interruption]:
    """A Poisson process of rate ``expected / wall_s`` over ``[0, wall_s)`` (exponential
    inter-arrival times), each event of a category drawn by count."""
    if wall_s <= 0 or expected < 0:
        raise ValueError(f"wall_s = {wall_s}, expected = {expected}: need wall_s > 0, expected >= 0")
    rng = random.Random(seed)
    queue = random.Random(f"queue-{seed}")
    pool = random.Random(f"pool-{seed}")
    host = random.Random(f"host-{seed}")
    events: list[Interruption] = []
    if expected == 0:
        return events
    rate = expected / wall_s
    weights = [c.count for c in categories]
    t = rng.expovariate(rate)
    while t < wall_s:
        c = rng.choices(categories, weights=weights)[0]
        events.append(Interruption(t, c.name, c.kind, c.replace, rng.random(), queue.random(),
                                   pool.random(), host.random()))
        t += rng.expovariate(rate)
    return events


def kind_shares(categories: tuple[Category, ...] = LLAMA3_CATEGORIES) -> dict[str, float]:
    total = sum(c.count for c in categories)
    return {k: sum(c.count for c in categories if c.kind == k) / total for k in KINDS}


def limit_draws(seed: int, n: int) -> list[float]:
    """Queue-wait draws of the allocations that follow a time limit (successor or resubmission),
    a stream of their own so that the interruption trace is the same with or without them."""
    rng = random.Random(f"limit-{seed}")
    return [rng.random() for _ in range(n)]
