"""Goodput at scale: ETTR of the recovery policies on a 16,384-GPU, 54-day run.

    .venv/bin/python -m bench.goodput [--runs 20] [--seed 0] [--config sim.toml]
        [--queue-median-s 3600] [--queue-sigma 1.0]
        [--drill-json drill.json] [--ckpt-json ckpt.json] [--timeline recoveries.json] [--json out.json]

A model, not a measurement. Policies: (a) a person restarts from the hourly checkpoint, (b)
Slurm's own requeue, (c) slurm-omni's resubmission, (d) slurm-omni inside the allocation with
spares (its supervisor in the batch script: losing the first node ends the allocation), and (e) the
same with the control plane outside the allocations (issue 20): the first node's loss recovered
inside, and pool allocations that grow a shrunk job back; (d) and (e) for every count of spares per
100 nodes in ``[alloc] spares_per_100``. (a)-(c) go back into the queue at every interruption (a
lognormal wait, ``[queue]`` or ``--queue-median-s``); (d) and (e) pay for their idle nodes and go
back into the queue only when out of spares and replicas; a pool waits in the same queue-wait
model. Each Monte-Carlo run draws one interruption trace (Poisson, Llama 3 categories) and plays
every policy on it. Printed: ETTR per policy (mean and the 5-95 % range over runs), lost time per
bucket, ETTR against spares per 100 nodes with and without pools, the best choice against the 97 %
target, where the remaining time goes (ml-goodput-measurement's badput names), the same at a
time limit per allocation (``[alloc] time_limit_h``: resubmission vs a successor requested ahead),
per-interruption costs, and every input with its source (public, assumption, measured file, config).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.goodput.failures import Interruption, interruption_trace, limit_draws
from bench.goodput.inputs import (
    Provenance,
    SimConfig,
    apply_ckpt,
    apply_drill,
    apply_scale,
    apply_timeline,
    load_config,
)
from bench.goodput.models import PolicyCosts, Scaled, in_allocation, memory_tier, scale, successor_lead
from bench.goodput.sim import BUCKETS, Outcome, simulate
from slurm_omni.errors import OmniError

TARGET_ETTR = 0.97
KEY_INPUTS = ("omni.detect_node_down_s", "omni.detect_task_crash_s", "omni.detect_hang_s", "omni.resubmit_s",
              "start.start_small_s", "omni.restore_small_s", "storage.host_copy_bw", "storage.node_write_bw",
              "storage.node_read_bw", "storage.critical_read_bw")


@dataclass(frozen=True, slots=True)
class Summary:
    policy: str
    ettr_mean: float
    ettr_p5: float
    ettr_p95: float
    hours: dict[str, float]
    interruptions: float
    absorbed: float
    shrinks: float
    waits: float
    resubmits: float = 0.0
    relaunches: float = 0.0
    spare_hours: float = 0.0
    """Idle spares, in the job's wall hours (node-hours / job nodes)."""
    grows: float = 0.0
    pools: float = 0.0
    host_losses: float = 0.0
    handovers: float = 0.0

    @property
    def paid_hours(self) -> float:
        """What the job paid for, in its wall hours: the wall plus its idle nodes."""
        return sum(self.hours.values()) + self.spare_hours


@dataclass(frozen=True, slots=True)
class SpareRow:
    """One row of the in-allocation sweep."""

    per_100: float
    spares: int
    summary: Summary
    pools: bool = False
    memory: bool = False
    """With the memory tier (``[memory]``; models.memory_tier)."""


def traces(cfg: SimConfig, *, runs: int, seed: int) -> list[list[Interruption]]:
    return [interruption_trace(wall_s=cfg.run.wall_s, expected=cfg.run.interruptions, seed=seed + i)
            for i in range(runs)]


def run_many(cfg: SimConfig, scaled: Scaled, *, runs: int, seed: int,
             events: list[list[Interruption]] | None = None) -> list[list[Outcome]]:
    """Outcomes per policy (outer) and run (inner); run i uses seed + i for all policies."""
    events = events if events is not None else traces(cfg, runs=runs, seed=seed)
    return [[simulate(policy, cfg.run, trace) for trace in events] for policy in scaled.policies]


def limit_draw_lists(cfg: SimConfig, *, runs: int, seed: int) -> list[list[float]]:
    """Run i's queue-wait draws of the allocations after a time limit (enough for one an hour)."""
    return [limit_draws(seed + i, int(cfg.run.wall_s / 3600) + 16) for i in range(runs)]


def run_spares(cfg: SimConfig, scaled: Scaled, *, runs: int, seed: int,
               events: list[list[Interruption]] | None = None, pools: bool = False,
               time_limit: bool = False, spares_per_100: Sequence[float] | None = None,
               memory: bool | None = None) -> list[SpareRow]:
    """The in-allocation mode for every ``alloc.spares_per_100`` (or ``spares_per_100``), on the
    same traces; ``pools``: the control plane outside, pools and successors (models.in_allocation);
    ``time_limit``: allocations end after ``[alloc] time_limit_h``; ``memory``: the memory tier
    (None: models.in_allocation's default)."""
    events = events if events is not None else traces(cfg, runs=runs, seed=seed)
    draws = limit_draw_lists(cfg, runs=len(events), seed=seed)
    rows = []
    for per_100 in (cfg.alloc.spares_per_100 if spares_per_100 is None else spares_per_100):
        policy = in_allocation(cfg, scaled.omni, per_100, pools=pools, time_limit=time_limit, memory=memory)
        rows.append(SpareRow(per_100, policy.spares or 0,
                             summarize([simulate(policy, cfg.run, trace, d) for trace, d in zip(events, draws, strict=True)]),
                             pools, bool(memory)))
    return rows


@dataclass(frozen=True, slots=True)
class LimitRow:
    """One row of the time-limit comparison: how the next allocation is obtained, and the outcome."""

    how: str
    summary: Summary


def run_limits(cfg: SimConfig, scaled: Scaled, *, runs: int, seed: int, events: list[list[Interruption]],
               per_100_today: float, per_100_pools: float) -> list[LimitRow]:
    """Allocations ending at ``[alloc] time_limit_h``: today's resubmission at the limit, and a
    successor requested ahead of it by the supervisor's own lead policy
    (``policy.pools.successor_lead_s``) with the site's expected queue wait at the queue's median,
    90th and 99th percentile (or the configured lead)."""
    rows = [LimitRow("resubmit at the limit (today)", run_spares(
        cfg, scaled, runs=runs, seed=seed, events=events, time_limit=True, spares_per_100=[per_100_today])[0].summary)]
    # the supervisor's own lead policy (policy.pools.successor_lead_s) with the site's expected
    # queue wait set to the queue's median, 90th or 99th percentile (or the configured lead)
    relaunch = scaled.figures["relaunch_s"]
    waits = ([None] if cfg.alloc.successor_lead_s is not None else
             [cfg.queue.median_s * math.exp(cfg.queue.sigma * statistics.NormalDist().inv_cdf(q))
              for q in (0.5, 0.9, 0.99)])
    for wait in waits:
        lead = successor_lead(cfg, relaunch, wait)
        c = dataclasses.replace(cfg, alloc=dataclasses.replace(cfg.alloc, successor_lead_s=lead))
        if lead >= c.alloc.time_limit_h * 3600:
            continue
        site = "" if wait is None else f" (site wait {wait / 3600:.1f} h)"
        rows.append(LimitRow(f"successor requested {lead / 3600:.1f} h ahead{site}", run_spares(
            c, scaled, runs=runs, seed=seed, events=events, pools=True, time_limit=True,
            spares_per_100=[per_100_pools])[0].summary))
    return rows


def best(summaries: Sequence[Summary], rows: Sequence[SpareRow]) -> tuple[str, Summary]:
    """The policy with the highest mean ETTR: a resubmitting one, or the best spare count."""
    choices = [(s.policy, s) for s in summaries] + [(r.summary.policy, r.summary) for r in rows]
    return max(choices, key=lambda c: c[1].ettr_mean)


def summarize(outcomes: Sequence[Outcome]) -> Summary:
    ettrs = sorted(o.ettr for o in outcomes)

    def pct(q: float) -> float:
        return ettrs[min(len(ettrs) - 1, max(0, round(q * (len(ettrs) - 1))))]

    n = len(outcomes)
    return Summary(
        outcomes[0].policy, statistics.fmean(ettrs), pct(0.05), pct(0.95),
        {b: sum(o.seconds[b] for o in outcomes) / n / 3600 for b in BUCKETS},
        sum(o.interruptions for o in outcomes) / n, sum(o.absorbed for o in outcomes) / n,
        sum(o.shrinks for o in outcomes) / n,
        sum(o.waits for o in outcomes) / n, sum(o.resubmits for o in outcomes) / n,
        sum(o.relaunches for o in outcomes) / n, sum(o.spare_s for o in outcomes) / n / 3600,
        sum(o.grows for o in outcomes) / n, sum(o.pools for o in outcomes) / n,
        sum(o.host_losses for o in outcomes) / n, sum(o.handovers for o in outcomes) / n)


# Badput causes in the vocabulary of Google's ml-goodput-measurement (its BadputType names), and the
# buckets of sim.BUCKETS each one sums; the last three are outside what that library measures.
BADPUT: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("checkpoint save (UNPRODUCTIVE_CHECKPOINT_SAVE_TIME)", ("checkpoint",)),
    ("checkpoint restore (UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME)", ("restore",)),
    ("wasted progress (WASTED_PROGRESS_FROM_DISRUPTION)", ("recompute",)),
    ("infrastructure recovery (INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION)", ("detection", "restart", "waiting")),
    ("running shrunk (ELASTIC_SLICE_DOWN)", ("shrunk",)),
    ("grow-back relaunch (ELASTIC_SCALE_UP)", ("grow",)),
    ("time-limit handover (not in the library: a planned new start)", ("handover",)),
    ("queue wait (not in the library: outside any allocation)", ("queue",)),
)
IDLE = "idle nodes held (not in the library: paid, not running)"

# Where each default of the pool and allocation model comes from (bench/goodput/inputs.py says more);
# a config file or the command line replaces the source.
SOURCES: dict[str, str] = {
    "run.gpus": "public: Llama 3 paper (2024), 16,384 H100",
    "run.days": "public: Llama 3 paper, 54 days",
    "run.interruptions": "public: Llama 3 paper table 5, 419 unexpected interruptions",
    "run.params": "public: Llama 3 405B",
    "run.step_time_s": "derived: 6 x 405e9 x 16M tokens / (16,384 GPUs x 400 TFLOP/s), Llama 3 paper's figures",
    "run.spare_nodes": "assumption: the cluster's free nodes (a)-(c) may take",
    "run.repair_s": "assumption: a failed node back in service in a day; bounds a pool's wait",
    "queue.median_s": "assumption: 'for a 2,000-node job, often hours' (issue 13); not measured",
    "queue.sigma": "assumption: lognormal, p90 = 3.6 x median; a pool's wait is drawn from the same model",
    "alloc.relaunch_small_s": ("goal of issue 13 (<= 3 s); measured 2.30 s median, node lost, idle: "
                               "python bench/recovery_bench.py (README)"),
    "start.init_s_per_1k_gpus": "assumption: communicator set-up and imports, about a minute at 16k GPUs",
    "alloc.min_dp_fraction": "policy: shrink down to this share of dp, then resubmit",
    "alloc.time_limit_h": "assumption: a shared centre's maximum wall time (only the time-limit section)",
    "alloc.successor_lead_s": "policy: unset -> the time-limit section sweeps the queue wait's p50, p90, p99",
    "storage.aggregate_write_bw": "public: Llama 3 paper, Tectonic 2 TB/s sustained",
    "storage.aggregate_read_bw": "assumption: as the write bandwidth",
    "memory.read_bw": ("measured: 2.8 GB/s restored from a tmpfs with huge pages, 1 GiB, python bench/ckpt_bench.py "
                       "--memory --memory-dir <tmpfs huge=within_size> (docs/checkpoint.md); --ckpt-json's "
                       "memory_restore_s replaces it"),
    "memory.peer_bw": "assumption: a 100 Gb/s front-end NIC per node carries the keepers' TCP copies",
    "memory.memory_every": "policy: 0 -> plan_cadence, the fewest steps that keep the snapshot's blocking under 1 %",
    "memory.files_every": "policy: 0 -> plan_cadence, the file system about as often as without the tier",
}


# Where the defaults of the measurable inputs come from until a drill or checkpoint file replaces them.
KEY_DEFAULTS: dict[str, str] = {
    "omni.detect_node_down_s": "default, assumption: ConfirmConfig's windows, 2 s heartbeats (omni drill measures it)",
    "omni.detect_task_crash_s": "default, assumption: as node_down (omni drill measures it)",
    "omni.detect_hang_s": "derived: ConfirmConfig's hang rule at the run's step time",
    "omni.resubmit_s": "default, assumption: plan < 50 ms (bench/plan_bench.py) + scontrol",
    "start.start_small_s": "default, assumption (omni drill measures it)",
    "omni.restore_small_s": "default, assumption (omni drill measures it)",
    "storage.host_copy_bw": "default, assumption: PCIe Gen5 x16 (--ckpt-json measures it)",
    "storage.node_write_bw": "default, assumption (--ckpt-json measures it)",
    "storage.node_read_bw": "default, assumption (--ckpt-json measures it)",
    "storage.critical_read_bw": "derived: node_read_bw unless --ckpt-json measures it",
}


def badput(s: Summary) -> list[tuple[str, float]]:
    """Lost hours by cause (ml-goodput-measurement's names where it has one), idle nodes last."""
    return [(name, sum(s.hours[b] for b in buckets)) for name, buckets in BADPUT] + [(IDLE, s.spare_hours)]


def target_gap(s: Summary) -> str:
    """How far ``s`` is from the target ETTR, and the causes that would have to shrink."""
    allowed = (1 - TARGET_ETTR) * s.paid_hours
    lost = s.paid_hours - s.hours["productive"]
    if lost <= allowed:
        return f"meets the {TARGET_ETTR:.0%} target: {lost:.1f} h lost of {s.paid_hours:.0f} h paid, it allows {allowed:.1f} h"
    top = sorted(badput(s), key=lambda c: -c[1])[:3]
    return (f"misses the {TARGET_ETTR:.0%} target by {lost - allowed:.1f} h ({lost:.1f} h lost of {s.paid_hours:.0f} h "
            "paid): it would take cutting " + ", ".join(f"{name.split(' (')[0]} ({h:.1f} h)" for name, h in top)
            + " by that much together")


def render(cfg: SimConfig, scaled: Scaled, summaries: Sequence[Summary], prov: Sequence[Provenance],
           *, runs: int, seed: int, rows: Sequence[SpareRow] = (), limits: Sequence[LimitRow] = ()) -> str:
    r, f = cfg.run, scaled.figures
    lines = [
        (f"goodput at scale (a model: a Monte-Carlo simulation, not a measurement): {r.gpus} GPUs ({r.nodes} "
         f"nodes; dp {r.data_parallel} x tp {r.tensor_parallel} x pp {r.pipeline_parallel}), {r.days:g} days, "
         f"{r.interruptions:g} unexpected interruptions expected (one per {f['mtbf_s'] / 3600:.2f} h), {runs} runs "
         f"(seeds {seed}..{seed + runs - 1})"),
        "",
        (f"queue wait at every trip through the queue, and of every pool allocation: lognormal, median "
         f"{cfg.queue.median_s:g} s, sigma {cfg.queue.sigma:g} (mean {_queue_mean(scaled.omni) / 3600:.2f} h); "
         f"a pool waits at most {r.repair_s / 3600:g} h (a failed node back in service)"),
        "",
        (f"{'policy':40} {'ETTR':>7} {'p5-p95':>15} | lost hours (mean): {'detect':>6} {'restart':>7} "
         f"{'restore':>7} {'queue':>6} {'wait':>5} {'recomp':>6} {'ckpt':>5} {'shrunk':>6} {'grow':>5} "
         f"{'idle':>5}"),
    ]
    for s in [*summaries, *(r.summary for r in rows)]:
        h = s.hours
        lines.append(
            f"{s.policy:40} {s.ettr_mean:7.2%} {s.ettr_p5:7.2%}-{s.ettr_p95:<7.2%} |                    "
            f"{h['detection']:6.1f} {h['restart']:7.1f} {h['restore']:7.1f} {h['queue']:6.1f} {h['waiting']:5.1f} "
            f"{h['recompute']:6.1f} {h['checkpoint']:5.2f} {h['shrunk']:6.2f} {h['grow']:5.2f} {s.spare_hours:5.1f}")
    today = [r for r in rows if not r.pools and not r.memory]
    pooled = {r.per_100: r for r in rows if r.pools and not r.memory}
    remembered = {r.per_100: r for r in rows if r.pools and r.memory}
    if rows:
        lines += ["", (f"ETTR against spares per 100 nodes (relaunch {f['relaunch_s']:.1f} s; shrink down to "
                       f"{cfg.alloc.min_dp_fraction:.0%} of dp {cfg.run.data_parallel}, then resubmit)"),
                  "  (d) without pools: the supervisor in the batch script; losing the first node ends the allocation",
                  ("  (e) with pools: the control plane outside; the first node recovered inside; running shrunk, "
                   "a pool allocation of the missing nodes, grown back by one relaunch when it starts"),
                  (f"  {'spares/100':>10} {'spares':>6} | {'(d) ETTR':>8} {'p5-p95':>15} {'shrinks':>7} {'resub':>5} "
                   f"{'host':>4} {'idle h':>6} | {'(e) ETTR':>8} {'p5-p95':>15} {'shrinks':>7} {'pools':>5} "
                   f"{'grows':>5} {'idle h':>6}" + (f" | {'(e)+memory':>10} {'p5-p95':>15}" if remembered else ""))]
        for d in today:
            s = d.summary
            line = (f"  {d.per_100:10g} {d.spares:6d} | {s.ettr_mean:8.2%} {s.ettr_p5:7.2%}-{s.ettr_p95:<7.2%} "
                    f"{s.shrinks:7.1f} {s.resubmits:5.1f} {s.host_losses:4.1f} {s.spare_hours:6.1f} |")
            e = pooled.get(d.per_100)
            if e is not None:
                t = e.summary
                line += (f" {t.ettr_mean:8.2%} {t.ettr_p5:7.2%}-{t.ettr_p95:<7.2%} {t.shrinks:7.1f} {t.pools:5.1f} "
                         f"{t.grows:5.1f} {t.spare_hours:6.1f}")
            m = remembered.get(d.per_100)
            if m is not None:
                u = m.summary
                line += f" | {u.ettr_mean:10.2%} {u.ettr_p5:7.2%}-{u.ettr_p95:<7.2%}"
            lines.append(line)
        if remembered:
            lines += memory_lines(cfg, scaled, pooled, remembered)
    name, top = best(summaries, rows)
    resub = summaries[-1]
    lines += ["", (f"best choice: {name}: ETTR {top.ettr_mean:.2%} (slurm-omni resubmission "
                   f"{resub.ettr_mean:.2%}, {(top.ettr_mean - resub.ettr_mean) * 100:+.2f} points)")]
    if today:
        no_pool = max(today, key=lambda x: x.summary.ettr_mean).summary
        lines.append(f"best without pools: {no_pool.policy}: ETTR {no_pool.ettr_mean:.2%}")
    lines.append(f"best ETTR / {TARGET_ETTR:.0%} target = {top.ettr_mean / TARGET_ETTR:.3f} ({target_gap(top)})")
    best_rows = [x for x in (max(today, key=lambda x: x.summary.ettr_mean) if today else None,
                         max(pooled.values(), key=lambda x: x.summary.ettr_mean) if pooled else None,
                         max(remembered.values(), key=lambda x: x.summary.ettr_mean) if remembered else None) if x]
    if best_rows:
        lines += ["", "where the remaining time goes (hours; share of the paid time; ml-goodput-measurement's names):",
                  f"  {'cause':68} " + " ".join(f"{_short(x):>30}" for x in best_rows)]
        causes = [badput(x.summary) for x in best_rows]
        for i, (cause, _) in enumerate(causes[0]):
            lines.append(f"  {cause:68} " + " ".join(
                f"{c[i][1]:14.1f} h {c[i][1] / x.summary.paid_hours:13.2%}" for c, x in zip(causes, best_rows, strict=True)))
    if limits:
        lines += ["", (f"at a time limit of {cfg.alloc.time_limit_h:g} h per allocation (every allocation, "
                       "pools included, ends by then; a planned save, then a fresh start on the next one):"),
                  f"  {'next allocation':52} {'ETTR':>7} {'p5-p95':>15} {'handovers':>9} {'queue h':>7} {'idle h':>6}"]
        for row in limits:
            s = row.summary
            lines.append(f"  {row.how:52} {s.ettr_mean:7.2%} {s.ettr_p5:7.2%}-{s.ettr_p95:<7.2%} "
                         f"{s.handovers:9.1f} {s.hours['queue']:7.1f} {s.spare_hours:6.1f}   {s.policy}")
        top_limit = max(limits, key=lambda x: x.summary.ettr_mean)
        lines.append(f"  best at the limit: {top_limit.how}: {target_gap(top_limit.summary)}")
    lines += ["", "per interruption (mean over kinds; seconds):"]
    shares = {k: f[f"share_{k}"] for k in ("node_down", "task_crash", "hang")}
    for p, s in zip(scaled.policies, summaries, strict=True):
        detect = sum(shares[k] * _mean_detection(p, k) for k in shares)
        lost = s.hours["recompute"] * 3600 / max(s.interruptions, 1e-9)
        lines.append(f"  {p.name:34} detect {detect:7.1f}  restart {p.restart_s:7.1f}  lost work {lost:7.1f}"
                     f"  ckpt every {p.ckpt_interval_s:6.0f} (blocks {p.ckpt_blocking_s:.3f})"
                     f"  hit {s.interruptions:.0f}, absorbed {s.absorbed:.0f}, shrinks {s.shrinks:.1f}, waits {s.waits:.1f}")
    gb = 1e9
    origin = {p.name: p.source for p in prov}
    start_note = (f" (start at {cfg.run.nodes} nodes {cfg.start.start_at_scale_s:.1f} s, "
                  f"{origin.get('start.start_at_scale_s', 'config')}, + communicator set-up "
                  f"{cfg.start.init_s_per_1k_gpus:g} s per 1k GPUs, an assumption)"
                  if cfg.start.start_at_scale_s is not None else "")
    scan_note = " (inside the measured detection)" if "omni.heartbeat_read_s" in origin and \
        origin["omni.heartbeat_read_s"].startswith("measured") else ""
    lines += ["", "models at scale:",
              (f"  checkpoint written per GPU {f['write_per_gpu_bytes'] / gb:.3f} GB, per node "
              f"{f['write_per_node_bytes'] / gb:.2f} GB; read per node on restore "
              f"{f['read_per_node_bytes'] / gb:.1f} GB (critical {f['critical_per_node_bytes'] / gb:.1f} GB)"),
              (f"  per-node storage share: read {f['node_read_bw'] / gb:.2f} GB/s, write {f['node_write_bw'] / gb:.2f}"
              f" GB/s -> blocking {f['blocking_s']:.3f} s, persist {f['persist_s']:.1f} s, restore full "
              f"{f['restore_full_s']:.1f} s / critical {f['restore_critical_s']:.1f} s"),
              (f"  job start {f['start_s']:.1f} s{start_note}; slurm-omni: hang confirm "
              f"{f['omni_hang_detect_s']:.0f} s, heartbeat scan {f['heartbeat_scan_s']:.1f} s{scan_note}, async ckpt every "
              f"{f['omni_ckpt_interval_s']:.0f} s"),
              *([f"  detection at {cfg.run.nodes} nodes: " + ", ".join(
                  f"{k} {getattr(cfg.omni, f'detect_{k}_s'):.1f} s" for k in ("node_down", "task_crash", "hang"))
                 + f" ({origin['omni.detect_node_down_s']})"] if "omni.detect_node_down_s" in origin
                and origin["omni.detect_node_down_s"].startswith("measured, extrapolated") else []),
              "  interruption kinds: " + ", ".join(f"{k} {v:.1%}" for k, v in shares.items()),
              "", ("inputs the drills and the checkpoint benchmark measure, and any config override "
                   "(defaults documented in bench/goodput/inputs.py):")]
    source = {p.name: p.source for p in prov}
    for name in KEY_INPUTS:
        section, key = name.split(".")
        value = getattr(getattr(cfg, section), key)
        shown = "(see models)" if value is None else f"{value:<14.6g}"
        lines.append(f"  {name:28} = {shown:<14} {source.get(name, KEY_DEFAULTS.get(name, 'default'))}")
    lines += [f"  {p.name:28} = {p.value:<14.6g} {p.source}" for p in prov
              if p.name not in KEY_INPUTS and p.name not in SOURCES]
    lines += ["", ("inputs of the run, the queue, the pools and the allocations (source of the default; an "
                   "override names its own):")]
    for name, why in SOURCES.items():
        section, key = name.split(".")
        value = getattr(getattr(cfg, section), key)
        shown = "(unset)" if value is None else f"{value:<14.6g}"
        lines.append(f"  {name:28} = {shown:<14} {source.get(name, why)}")
    return "\n".join(lines)


def _short(row: SpareRow) -> str:
    return f"{'(e) pools' if row.pools else '(d) no pools'}{' + memory' if row.memory else ''}, {row.per_100:g} spares/100"


def memory_lines(cfg: SimConfig, scaled: Scaled, pooled: dict[float, SpareRow],
                 remembered: dict[float, SpareRow]) -> list[str]:
    """The memory tier against the same pools without it: its cadence, the work lost per interruption,
    a relaunch's restore, and the best ETTR of each (every figure from the model and the simulation)."""
    tier = memory_tier(cfg, scaled.omni)
    c, step = tier.cadence, cfg.run.step_time_s
    with_tier = max(remembered.values(), key=lambda x: x.summary.ettr_mean)
    without = max(pooled.values(), key=lambda x: x.summary.ettr_mean) if pooled else None
    nth = {1: "st", 2: "nd", 3: "rd"}.get(c.files_every % 10 if c.files_every % 100 not in (11, 12, 13) else 0, "th")
    files = (f"the file system every {c.files_every}{nth} ({c.files_every_steps} steps, "
             f"{tier.files_interval_s:.0f} s: {c.why})" if c.files_every else "the file system only at planned saves")

    def lost(row: SpareRow) -> float:
        return row.summary.hours["recompute"] * 3600 / max(row.summary.relaunches + row.summary.resubmits, 1e-9)

    out = ["", (f"  memory tier (models.memory_tier; the runtime's policy, policy/snapshot_cadence.py, with the run's "
                f"time between interruptions: Young/Daly): a snapshot "
                f"into memory every {c.memory_every} step{'s' if c.memory_every > 1 else ''} of {step:.1f} s (blocks "
                f"{tier.blocking_s:.3f} s, {tier.blocking_s / tier.interval_s:.2%}; in memory and at the ring peer "
                f"{tier.persist_s:.1f} s later), {files}"),
           (f"    relaunch restore {in_allocation(cfg, scaled.omni, 0, memory=False).relaunch_restore_s:.1f} s -> "
            f"{tier.restore_s:.1f} s (survivors from their memory, the replacement {tier.replacement_s:.1f} s from "
            f"its peer's); a new allocation restores from the file system")]
    if without is not None:
        out.append(f"    work lost per interruption {lost(without):.1f} s -> {lost(with_tier):.1f} s; best ETTR "
                   f"{without.summary.ettr_mean:.2%} ({_short(without)}) -> {with_tier.summary.ettr_mean:.2%} "
                   f"({_short(with_tier)})")
    return out


def _queue_mean(p: PolicyCosts) -> float:
    """The queue wait's mean over its own draw (midpoint rule on 2,000 points)."""
    return statistics.fmean(p.queue_s((i + 0.5) / 2000) for i in range(2000))


def _mean_detection(p: PolicyCosts, kind: str) -> float:
    """Mean detection of a kind over the event's own draw (midpoint rule on 2,000 points)."""
    return statistics.fmean(p.detection_s(kind, (i + 0.5) / 2000) for i in range(2000))


def config_toml(cfg: SimConfig) -> str:
    lines: list[str] = []
    for section in dataclasses.fields(cfg):
        lines.append(f"[{section.name}]")
        table = getattr(cfg, section.name)
        for f in dataclasses.fields(table):
            value = getattr(table, f.name)
            if value is None:
                lines.append(f"# {f.name} = (unset: derived, see bench/goodput/models.py)")
            elif isinstance(value, bool):
                lines.append(f"{f.name} = {str(value).lower()}")
            elif isinstance(value, tuple):
                lines.append(f"{f.name} = [{', '.join(repr(v) for v in value)}]")
            else:
                lines.append(f"{f.name} = {value!r}")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="Monte-Carlo runs (seeds seed..seed+runs-1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", type=Path, help="TOML overriding defaults ([run], [storage], [start], ...)")
    ap.add_argument("--drill-json", type=Path, help="measured drill timeline (format: bench/goodput/inputs.py)")
    ap.add_argument("--ckpt-json", type=Path, help="checkpoint benchmark result (format: inputs.py)")
    ap.add_argument("--timeline", type=Path, help="the manager's recovery timeline JSON")
    ap.add_argument("--scale-json", type=Path, help="bench/scale_bench.py's figures: detection and the job start "
                    "at the run's node count from their fitted growth (format: inputs.py)")
    ap.add_argument("--json", type=Path, help="also write the summaries as JSON here")
    ap.add_argument("--queue-median-s", type=float, help="median queue wait of a trip through the queue "
                    "(lognormal; default [queue] median_s = 3600; 0: no queue)")
    ap.add_argument("--queue-sigma", type=float, help="log-standard deviation of the queue wait (default 1.0)")
    ap.add_argument("--print-config", action="store_true",
                    help="print the effective inputs as TOML (a starting point for --config) and exit")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    try:
        cfg, prov = load_config(args.config)
        for path, apply in ((args.timeline, apply_timeline), (args.drill_json, apply_drill),
                            (args.ckpt_json, apply_ckpt), (args.scale_json, apply_scale)):
            if path is not None:
                cfg, more = apply(cfg, path)
                prov += more
        queue = {k: v for k, v in (("median_s", args.queue_median_s), ("sigma", args.queue_sigma)) if v is not None}
        if queue:
            cfg = dataclasses.replace(cfg, queue=dataclasses.replace(cfg.queue, **queue))
            prov += [Provenance(f"queue.{k}", v, "command line") for k, v in queue.items()]
        if args.print_config:
            print(config_toml(cfg))
            return 0
        scaled = scale(cfg)
    except OmniError as e:
        print(f"goodput: {e}" if not str(e).startswith("goodput:") else str(e), file=sys.stderr)
        return e.exit_code
    events = traces(cfg, runs=args.runs, seed=args.seed)
    summaries = [summarize(o) for o in run_many(cfg, scaled, runs=args.runs, seed=args.seed, events=events)]
    # with and without the memory tier, on the same traces ([memory]; --ckpt-json's memory restore feeds it)
    rows = run_spares(cfg, scaled, runs=args.runs, seed=args.seed, events=events, memory=False)
    pooled = run_spares(cfg, scaled, runs=args.runs, seed=args.seed, events=events, pools=True, memory=False)
    remembered = run_spares(cfg, scaled, runs=args.runs, seed=args.seed, events=events, pools=True, memory=True)
    limits = (run_limits(cfg, scaled, runs=args.runs, seed=args.seed, events=events,
                         per_100_today=max(rows, key=lambda x: x.summary.ettr_mean).per_100,
                         per_100_pools=max(pooled, key=lambda x: x.summary.ettr_mean).per_100)
              if cfg.alloc.time_limit_h > 0 else [])
    rows = [*rows, *pooled, *remembered]
    print(render(cfg, scaled, summaries, prov, runs=args.runs, seed=args.seed, rows=rows, limits=limits))
    if args.json:
        payload = {"target_ettr": TARGET_ETTR, "runs": args.runs, "seed": args.seed,
                   "policies": [{"policy": s.policy, "ettr_mean": s.ettr_mean, "ettr_p5": s.ettr_p5,
                                 "ettr_p95": s.ettr_p95, "lost_hours": s.hours} for s in summaries],
                   "in_allocation": [{"spares_per_100": r.per_100, "spares": r.spares, "policy": r.summary.policy,
                                      "ettr_mean": r.summary.ettr_mean, "ettr_p5": r.summary.ettr_p5,
                                      "ettr_p95": r.summary.ettr_p95, "lost_hours": r.summary.hours,
                                      "idle_spare_hours": r.summary.spare_hours,
                                      "relaunches": r.summary.relaunches, "resubmits": r.summary.resubmits,
                                      "shrinks": r.summary.shrinks, "pools": r.pools, "memory_tier": r.memory,
                                      "pool_allocations": r.summary.pools, "grows": r.summary.grows,
                                      "batch_host_losses": r.summary.host_losses,
                                      "badput_hours": dict(badput(r.summary))} for r in rows],
                   "time_limit": [{"next_allocation": x.how, "policy": x.summary.policy,
                                   "time_limit_h": cfg.alloc.time_limit_h, "ettr_mean": x.summary.ettr_mean,
                                   "handovers": x.summary.handovers, "lost_hours": x.summary.hours,
                                   "idle_hours": x.summary.spare_hours} for x in limits],
                   "best": best(summaries, rows)[0],
                   "inputs": [{"name": p.name, "value": p.value, "source": p.source} for p in prov],
                   "figures": scaled.figures}
        tmp = args.json.with_name(f".{args.json.name}.tmp")
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
