"""Goodput at scale: ETTR of the recovery policies on a 16,384-GPU, 54-day run.

    .venv/bin/python -m bench.goodput [--runs 20] [--seed 0] [--config sim.toml]
        [--queue-median-s 3600] [--queue-sigma 1.0]
        [--drill-json drill.json] [--ckpt-json ckpt.json] [--timeline recoveries.json] [--json out.json]

Policies: (a) a person restarts from the hourly checkpoint, (b) Slurm's own requeue, (c)
slurm-omni's resubmission, and (d) slurm-omni inside the allocation with spares, for every count of
spares per 100 nodes in ``[alloc] spares_per_100``. (a)-(c) go back into the queue at every
interruption (a lognormal wait, ``[queue]`` or ``--queue-median-s``); (d) pays for its idle spares
and goes back into the queue only when it runs out of spares and replicas. Each Monte-Carlo run draws
one interruption trace (Poisson, Llama 3 categories) and plays every policy on it. Printed: ETTR per
policy (mean and the 5-95 % range over runs), lost time per bucket, per-interruption costs, ETTR
against the spares per 100 nodes, the best choice and its ETTR against the 97 % target, and every
input with its source (default, config file, measured file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.goodput.failures import Interruption, interruption_trace
from bench.goodput.inputs import (
    Provenance,
    SimConfig,
    apply_ckpt,
    apply_drill,
    apply_timeline,
    load_config,
)
from bench.goodput.models import PolicyCosts, Scaled, in_allocation, scale
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


@dataclass(frozen=True, slots=True)
class SpareRow:
    """One row of the in-allocation sweep."""

    per_100: float
    spares: int
    summary: Summary


def traces(cfg: SimConfig, *, runs: int, seed: int) -> list[list[Interruption]]:
    return [interruption_trace(wall_s=cfg.run.wall_s, expected=cfg.run.interruptions, seed=seed + i)
            for i in range(runs)]


def run_many(cfg: SimConfig, scaled: Scaled, *, runs: int, seed: int,
             events: list[list[Interruption]] | None = None) -> list[list[Outcome]]:
    """Outcomes per policy (outer) and run (inner); run i uses seed + i for all policies."""
    events = events if events is not None else traces(cfg, runs=runs, seed=seed)
    return [[simulate(policy, cfg.run, trace) for trace in events] for policy in scaled.policies]


def run_spares(cfg: SimConfig, scaled: Scaled, *, runs: int, seed: int,
               events: list[list[Interruption]] | None = None) -> list[SpareRow]:
    """The in-allocation mode for every ``alloc.spares_per_100``, on the same traces."""
    events = events if events is not None else traces(cfg, runs=runs, seed=seed)
    rows = []
    for per_100 in cfg.alloc.spares_per_100:
        policy = in_allocation(cfg, scaled.omni, per_100)
        rows.append(SpareRow(per_100, policy.spares or 0,
                             summarize([simulate(policy, cfg.run, trace) for trace in events])))
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
        sum(o.relaunches for o in outcomes) / n, sum(o.spare_s for o in outcomes) / n / 3600)


def render(cfg: SimConfig, scaled: Scaled, summaries: Sequence[Summary], prov: Sequence[Provenance],
           *, runs: int, seed: int, rows: Sequence[SpareRow] = ()) -> str:
    r, f = cfg.run, scaled.figures
    lines = [
        (f"goodput at scale: {r.gpus} GPUs ({r.nodes} nodes; dp {r.data_parallel} x tp {r.tensor_parallel} x "
        f"pp {r.pipeline_parallel}), {r.days:g} days, {r.interruptions:g} unexpected interruptions expected "
        f"(one per {f['mtbf_s'] / 3600:.2f} h), {runs} runs (seeds {seed}..{seed + runs - 1})"),
        "",
        (f"queue wait at every trip through the queue: lognormal, median {cfg.queue.median_s:g} s, sigma "
         f"{cfg.queue.sigma:g} (mean {_queue_mean(scaled.omni) / 3600:.2f} h)"),
        "",
        (f"{'policy':40} {'ETTR':>7} {'p5-p95':>15} | lost hours (mean): "
        f"{'detect':>7} {'restart':>7} {'queue':>7} {'wait':>6} {'recomp':>7} {'ckpt':>6} {'shrunk':>6} "
        f"{'spares':>6}"),
    ]
    shown = [*summaries, *(r.summary for r in rows)]
    for s in shown:
        h = s.hours
        lines.append(
            f"{s.policy:40} {s.ettr_mean:7.2%} {s.ettr_p5:7.2%}-{s.ettr_p95:<7.2%} |                    "
            f"{h['detection']:7.1f} {h['restart']:7.1f} {h['queue']:7.1f} {h['waiting']:6.1f} "
            f"{h['recompute']:7.1f} {h['checkpoint']:6.2f} {h['shrunk']:6.2f} {s.spare_hours:6.1f}")
    if rows:
        lines += ["", (f"in allocation: ETTR against spares per 100 nodes (relaunch {f['relaunch_s']:.1f} s; shrink "
                       f"down to {cfg.alloc.min_dp_fraction:.0%} of dp {cfg.run.data_parallel}, then resubmit)"),
                  (f"  {'spares/100':>10} {'spares':>6} {'ETTR':>7} {'p5-p95':>15} {'relaunch':>8} {'shrinks':>7} "
                   f"{'resubmit':>8} {'queue h':>7} {'idle h':>6}")]
        for r in rows:
            s = r.summary
            lines.append(f"  {r.per_100:10g} {r.spares:6d} {s.ettr_mean:7.2%} {s.ettr_p5:7.2%}-{s.ettr_p95:<7.2%} "
                         f"{s.relaunches:8.1f} {s.shrinks:7.1f} {s.resubmits:8.1f} {s.hours['queue']:7.1f} "
                         f"{s.spare_hours:6.1f}")
    name, top = best(summaries, rows)
    resub = summaries[-1]
    lines += ["", (f"best choice: {name}: ETTR {top.ettr_mean:.2%} (slurm-omni resubmission "
                   f"{resub.ettr_mean:.2%}, {(top.ettr_mean - resub.ettr_mean) * 100:+.2f} points)"),
              (f"best ETTR / {TARGET_ETTR:.0%} target = {top.ettr_mean / TARGET_ETTR:.3f} "
              f"({'meets' if top.ettr_mean >= TARGET_ETTR else 'misses'} the target)"), "",
              "per interruption (mean over kinds; seconds):"]
    shares = {k: f[f"share_{k}"] for k in ("node_down", "task_crash", "hang")}
    for p, s in zip(scaled.policies, summaries, strict=True):
        detect = sum(shares[k] * _mean_detection(p, k) for k in shares)
        lost = s.hours["recompute"] * 3600 / max(s.interruptions, 1e-9)
        lines.append(f"  {p.name:34} detect {detect:7.1f}  restart {p.restart_s:7.1f}  lost work {lost:7.1f}"
                     f"  ckpt every {p.ckpt_interval_s:6.0f} (blocks {p.ckpt_blocking_s:.3f})"
                     f"  hit {s.interruptions:.0f}, absorbed {s.absorbed:.0f}, shrinks {s.shrinks:.1f}, waits {s.waits:.1f}")
    gb = 1e9
    lines += ["", "models at scale:",
              (f"  checkpoint written per GPU {f['write_per_gpu_bytes'] / gb:.3f} GB, per node "
              f"{f['write_per_node_bytes'] / gb:.2f} GB; read per node on restore "
              f"{f['read_per_node_bytes'] / gb:.1f} GB (critical {f['critical_per_node_bytes'] / gb:.1f} GB)"),
              (f"  per-node storage share: read {f['node_read_bw'] / gb:.2f} GB/s, write {f['node_write_bw'] / gb:.2f}"
              f" GB/s -> blocking {f['blocking_s']:.3f} s, persist {f['persist_s']:.1f} s, restore full "
              f"{f['restore_full_s']:.1f} s / critical {f['restore_critical_s']:.1f} s"),
              (f"  job start {f['start_s']:.1f} s; slurm-omni: hang confirm {f['omni_hang_detect_s']:.0f} s, "
              f"heartbeat scan {f['heartbeat_scan_s']:.1f} s, async ckpt every {f['omni_ckpt_interval_s']:.0f} s"),
              "  interruption kinds: " + ", ".join(f"{k} {v:.1%}" for k, v in shares.items()),
              "", ("inputs the drills and the checkpoint benchmark measure, and any config override "
                   "(default: the documented value in bench/goodput/inputs.py):")]
    source = {p.name: p.source for p in prov}
    for name in KEY_INPUTS:
        section, key = name.split(".")
        value = getattr(getattr(cfg, section), key)
        shown = "(see models)" if value is None else f"{value:<14.6g}"
        lines.append(f"  {name:28} = {shown:<14} {source.get(name, 'default')}")
    lines += [f"  {p.name:28} = {p.value:<14.6g} {p.source}" for p in prov if p.name not in KEY_INPUTS]
    return "\n".join(lines)


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
                            (args.ckpt_json, apply_ckpt)):
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
    rows = run_spares(cfg, scaled, runs=args.runs, seed=args.seed, events=events)
    print(render(cfg, scaled, summaries, prov, runs=args.runs, seed=args.seed, rows=rows))
    if args.json:
        payload = {"target_ettr": TARGET_ETTR, "runs": args.runs, "seed": args.seed,
                   "policies": [{"policy": s.policy, "ettr_mean": s.ettr_mean, "ettr_p5": s.ettr_p5,
                                 "ettr_p95": s.ettr_p95, "lost_hours": s.hours} for s in summaries],
                   "in_allocation": [{"spares_per_100": r.per_100, "spares": r.spares, "policy": r.summary.policy,
                                      "ettr_mean": r.summary.ettr_mean, "ettr_p5": r.summary.ettr_p5,
                                      "ettr_p95": r.summary.ettr_p95, "lost_hours": r.summary.hours,
                                      "idle_spare_hours": r.summary.spare_hours,
                                      "relaunches": r.summary.relaunches, "resubmits": r.summary.resubmits,
                                      "shrinks": r.summary.shrinks} for r in rows],
                   "best": best(summaries, rows)[0],
                   "inputs": [{"name": p.name, "value": p.value, "source": p.source} for p in prov],
                   "figures": scaled.figures}
        tmp = args.json.with_name(f".{args.json.name}.tmp")
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
