"""The report's figure: six panels drawn with matplotlib's Agg canvas into PNG bytes.

Loss across the failure (reference overlaid), throughput over time (downtime shaded), the recovery
timeline as horizontal bars, heartbeat lag per rank, checkpoint blocking and persist times, and the
summary table as text. No pyplot: a Figure on its own canvas keeps no global state.
"""

from __future__ import annotations

import io
import itertools
from collections import defaultdict
from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from slurm_omni.report.inputs import HeartbeatRecord
from slurm_omni.report.summary import StepPoint, loss_by_step
from slurm_omni.report.timeline import Recovery

PHASES = (("fault", "detected", "fault -> detected", "#d62728"),
          ("detected", "confirmed", "detected -> confirmed", "#ff7f0e"),
          ("confirmed", "resubmitted", "confirmed -> resubmitted", "#9467bd"),
          ("resubmitted", "running", "resubmitted -> running", "#1f77b4"),
          ("running", "first_step_after_restore", "running -> first step", "#2ca02c"))


def _empty(ax: Axes, title: str, why: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="#666")
    ax.set_xticks([])
    ax.set_yticks([])


def _loss(ax: Axes, points: Sequence[StepPoint], reference: Sequence[StepPoint],
          recoveries: Sequence[Recovery]) -> None:
    by_inc: dict[int, list[StepPoint]] = defaultdict(list)
    for p in points:
        if p.loss is not None:
            by_inc[p.incarnation].append(p)
    if not by_inc:
        _empty(ax, "loss", "no loss in the metrics (text-stage ranks log it)")
        return
    for inc, ps in sorted(by_inc.items()):
        ps.sort(key=lambda p: p.step)
        ax.plot([p.step for p in ps], [p.loss or 0.0 for p in ps], marker=".", ms=3, lw=1.2,
                label=f"incarnation {inc}")
    ref = loss_by_step(reference)
    if ref:
        ax.plot(list(ref), list(ref.values()), "k--", lw=1, label="reference (never failed)")
        run = loss_by_step(points)
        common = sorted(set(run) & set(ref))
        if common:
            twin = ax.twinx()
            twin.plot(common, [run[s] - ref[s] for s in common], color="#7f7f7f", lw=0.8, alpha=0.8,
                      label="run - reference")
            twin.set_ylabel("run - reference", color="#7f7f7f")
            twin.legend(fontsize=7, loc="lower left")
    for rec in recoveries:
        last = [p.step for p in points if p.incarnation == rec.incarnation]
        if last:
            ax.axvline(max(last), color="#d62728", ls=":", lw=1)
    ax.set_title("loss across the failure")
    ax.set_xlabel("global step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7)


def _throughput(ax: Axes, points: Sequence[StepPoint], recoveries: Sequence[Recovery], t0: float,
                names: dict[int, str]) -> None:
    if all(p.global_samples_per_s is None for p in points):
        _empty(ax, "throughput", "no global_samples_per_second in the metrics")
        return
    # One line per incarnation: no line drawn across the downtime.
    incarnations = sorted({p.incarnation for p in points})
    for n, inc in enumerate(incarnations):
        pairs = [(p.time - t0, p.global_samples_per_s) for p in points
                 if p.incarnation == inc and p.global_samples_per_s is not None]
        ax.plot([x for x, _y in pairs], [y for _x, y in pairs], ".-", ms=3, lw=1,
                color="#1f77b4", label="job samples/s" if n == 0 else None)
    ax.set_ylabel("samples/s")
    stages = sorted({s for p in points for s in p.tokens_per_s_by_stage})
    if stages:
        twin = ax.twinx()
        for stage, color in zip(stages, ("#ff7f0e", "#2ca02c", "#9467bd", "#8c564b"), strict=False):
            for n, inc in enumerate(incarnations):
                ps = [p for p in points if p.incarnation == inc and stage in p.tokens_per_s_by_stage]
                twin.plot([p.time - t0 for p in ps], [p.tokens_per_s_by_stage[stage] for p in ps], lw=0.8,
                          alpha=0.7, color=color, label=f"{names.get(stage, f'stage {stage}')} tokens/s" if n == 0 else None)
        twin.set_ylabel("tokens/s per stage")
        twin.legend(fontsize=7, loc="lower right")
    for rec in recoveries:
        start = rec.fault if rec.fault is not None else rec.detected or rec.confirmed
        end = rec.first_step_after_restore
        if end is not None:
            ax.axvspan(start - t0, end - t0, color="#d62728", alpha=0.15)
    ax.set_title("throughput over time (shaded: fault -> first step)")
    ax.set_xlabel("seconds since the first metrics record")
    ax.legend(fontsize=7, loc="lower left")


def _timeline(ax: Axes, recoveries: Sequence[Recovery]) -> None:
    timed = [r for r in recoveries if r.first_step_after_restore is not None or r.resubmitted is not None]
    if not timed:
        _empty(ax, "recovery timeline", "no recovery timeline given")
        return
    seen: set[str] = set()
    for i, rec in enumerate(timed):
        origin = rec.fault if rec.fault is not None else rec.detected or rec.confirmed
        for a, b, label, color in PHASES:
            ta, tb = getattr(rec, a), getattr(rec, b)
            if ta is None or tb is None:
                continue
            ax.barh(i, tb - ta, left=ta - origin, height=0.5, color=color,
                    label=None if label in seen else label)
            seen.add(label)
    ax.set_yticks(range(len(timed)), [f"{r.job_id} inc {r.incarnation}" + (f"\n{r.path}" if r.path else "")
                                      for r in timed], fontsize=7)
    ax.set_ylim(len(timed) - 0.4, -0.6 - 0.4 * len(PHASES) / max(len(timed), 1))
    ax.set_title("recovery timeline")
    ax.set_xlabel("seconds since the fault")
    ax.legend(fontsize=7)


def _heartbeats(ax: Axes, beats: Sequence[HeartbeatRecord], t0: float, t_end: float) -> None:
    if not beats:
        _empty(ax, "heartbeat lag", "no heartbeat files given")
        return
    by_rank: dict[int, list[HeartbeatRecord]] = defaultdict(list)
    for b in beats:
        by_rank[b.rank].append(b)
    end = max(t_end, max(b.time for b in beats))
    if all(len(bs) == 1 for bs in by_rank.values()):
        # Only the final heartbeat files: each rank's age at the end of the run.
        ranks = sorted(by_rank)
        ax.bar([str(r) for r in ranks], [end - by_rank[r][0].time for r in ranks], color="#1f77b4")
        for i, r in enumerate(ranks):
            ax.text(i, end - by_rank[r][0].time, by_rank[r][0].phase or "?", ha="center", va="bottom", fontsize=7)
        ax.set_title("heartbeat age at the end of the run, per rank")
        ax.set_xlabel("rank")
        ax.set_ylabel("seconds")
        return
    for rank, bs in sorted(by_rank.items()):
        bs.sort(key=lambda b: b.time)
        xs = [b.time - t0 for b in bs[1:]] + [end - t0]
        ys = [b.time - a.time for a, b in itertools.pairwise(bs)] + [end - bs[-1].time]
        ax.plot(xs, ys, ".-", ms=4, lw=1, label=f"rank {rank} ({bs[-1].phase or '?'})")
    ax.set_title("heartbeat lag (gap to the previous beat; last point: age at the end)")
    ax.set_xlabel("seconds since the first metrics record")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=6, ncol=2)


def _checkpoints(ax: Axes, points: Sequence[StepPoint]) -> None:
    blocking = [(p.step, p.ckpt_blocking_s) for p in points if p.ckpt_blocking_s is not None]
    persist = [(p.step, p.ckpt_persist_s) for p in points if p.ckpt_persist_s is not None]
    if not blocking and not persist:
        _empty(ax, "checkpoint times", "no checkpoint times in the metrics")
        return
    if blocking:
        ax.plot(*zip(*blocking, strict=True), "o-", ms=3, lw=1, label="blocking (snapshot)")
    if persist:
        ax.plot(*zip(*persist, strict=True), "s-", ms=3, lw=1, label="persist (to durable)")
    ax.set_title("checkpoint blocking and persist times")
    ax.set_xlabel("global step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)


def render_png(points: Sequence[StepPoint], reference: Sequence[StepPoint], recoveries: Sequence[Recovery],
               beats: Sequence[HeartbeatRecord], summary_text: str, *, title: str,
               stage_names: dict[int, str] | None = None) -> bytes:
    """The six panels; ``stage_names``: stage index -> the job's own name for it (the legend's)."""
    fig = Figure(figsize=(15, 13), dpi=90, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 2)
    t0 = min(p.time for p in points)
    t_end = max(p.time for p in points)
    _loss(axes[0][0], points, reference, recoveries)
    _throughput(axes[0][1], points, recoveries, t0, stage_names or {})
    _timeline(axes[1][0], recoveries)
    _heartbeats(axes[1][1], beats, t0, t_end)
    _checkpoints(axes[2][0], points)
    text = axes[2][1]
    text.axis("off")
    text.text(0, 1, summary_text, family="monospace", fontsize=7, va="top", ha="left", wrap=False)
    fig.suptitle(title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
