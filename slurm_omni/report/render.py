"""The report's text forms: the plain-text summary table, the Prometheus textfile, the HTML page and
the JSON summary. Pure: a summary in, strings out."""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Callable

from slurm_omni.report.summary import RecoverySummary, ReportSummary

Getter = Callable[[RecoverySummary], float | int | None]

FIELDS: tuple[tuple[str, str, str, str, Getter], ...] = (
    # (column and JSON key, text format, Prometheus gauge, gauge help, value)
    ("detection_s", "{:.2f}", "detection_seconds", "Fault to confirmed.", lambda r: r.detection_s),
    ("recovery_s", "{:.2f}", "recovery_seconds", "Confirmed to first step after restore.",
     lambda r: r.recovery_s),
    ("steps_lost", "{:d}", "steps_lost", "Steps recomputed after the recovery.", lambda r: r.steps_lost),
    ("thr_before", "{:.2f}", "throughput_before", "Global samples/s before the fault (median).",
     lambda r: r.throughput_before),
    ("thr_after", "{:.2f}", "throughput_after", "Global samples/s after the restore (median).",
     lambda r: r.throughput_after),
    ("thr_ratio", "{:.3f}", "throughput_ratio", "Throughput after / before.", lambda r: r.throughput_ratio),
)

def _fmt(fmt: str, value: float | None) -> str:
    return "n/a" if value is None else fmt.format(value)


def text_table(s: ReportSummary) -> str:
    stages = f" ({' | '.join(s.stages)} stage{'s' if len(s.stages) > 1 else ''})" if s.stages else ""
    lines = [(f"omni report: job {s.job_id or '?'}{stages}, steps {s.first_step}..{s.last_step}, "
             f"incarnations {', '.join(map(str, s.incarnations))}, {s.wall_s:.1f} s of metrics")]
    header = ["recovery", "job", "inc", "kind", "path"] + [name for name, *_ in FIELDS]
    rows = [[str(i + 1), r.job_id, str(r.incarnation), r.kind or "-", r.path or "-"]
            + [_fmt(fmt, get(r)) for _n, fmt, _g, _h, get in FIELDS] for i, r in enumerate(s.recoveries)]
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    if not rows:
        lines.append("(no recovery: one incarnation and no timeline)")
    if s.max_loss_deviation is None:
        lines.append("max |loss - reference|: n/a (no reference run given, or no common step)")
    else:
        lines.append(f"max |loss - reference|: {s.max_loss_deviation:.6g} at step {s.max_loss_deviation_step} "
                     f"({s.loss_compared_steps} steps compared)")
    return "\n".join(lines)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prom_text(s: ReportSummary) -> str:
    """Gauges ``omni_report_*`` for node_exporter's textfile collector."""
    out: list[str] = []
    for _n, _f, name, help_text, get in FIELDS:
        samples = [(r, float(v)) for r in s.recoveries if (v := get(r)) is not None]
        if not samples:
            continue
        out += [f"# HELP omni_report_{name} {help_text}", f"# TYPE omni_report_{name} gauge"]
        out += [f'omni_report_{name}{{job="{_label(r.job_id)}",incarnation="{r.incarnation}",'
                f'kind="{_label(r.kind)}"}} {v!r}' for r, v in samples]
    job = f'job="{_label(s.job_id)}"'
    out += ["# HELP omni_report_recoveries Recoveries in the report.", "# TYPE omni_report_recoveries gauge",
            f"omni_report_recoveries{{{job}}} {len(s.recoveries)}",
            "# HELP omni_report_last_step Last global step in the metrics.", "# TYPE omni_report_last_step gauge",
            f"omni_report_last_step{{{job}}} {s.last_step}"]
    if s.max_loss_deviation is not None:
        out += ["# HELP omni_report_max_loss_deviation Max |loss - reference loss| over common steps.",
                "# TYPE omni_report_max_loss_deviation gauge",
                f"omni_report_max_loss_deviation{{{job}}} {s.max_loss_deviation!r}"]
    return "\n".join(out) + "\n"


def summary_json(s: ReportSummary) -> str:
    return json.dumps({
        "job_id": s.job_id, "first_step": s.first_step, "last_step": s.last_step,
        "incarnations": list(s.incarnations), "wall_s": s.wall_s, "stages": list(s.stages),
        "max_loss_deviation": s.max_loss_deviation, "max_loss_deviation_step": s.max_loss_deviation_step,
        "loss_compared_steps": s.loss_compared_steps,
        "recoveries": [{"job_id": r.job_id, "incarnation": r.incarnation, "kind": r.kind, "path": r.path,
                        **{name: get(r) for name, *_, get in FIELDS}} for r in s.recoveries],
    }, sort_keys=True) + "\n"


def html_page(s: ReportSummary, png: bytes, *, title: str) -> str:
    """A self-contained page: the PNG inline (base64) and the summary as tables."""
    head = ["recovery", "job", "incarnation", "kind", "path"] + [n for n, *_ in FIELDS]
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in
                         [str(i + 1), r.job_id, str(r.incarnation), r.kind or "-", r.path or "-"]
                         + [_fmt(fmt, get(r)) for _n, fmt, _g, _h, get in FIELDS]) + "</tr>\n"
        for i, r in enumerate(s.recoveries))
    loss = ("n/a" if s.max_loss_deviation is None
            else f"{s.max_loss_deviation:.6g} at step {s.max_loss_deviation_step} "
                 f"({s.loss_compared_steps} steps compared)")
    facts = [("job", s.job_id or "?"), ("steps", f"{s.first_step}..{s.last_step}"),
             ("incarnations", ", ".join(map(str, s.incarnations))), ("metrics span", f"{s.wall_s:.1f} s"),
             ("max |loss - reference|", loss)]
    image = base64.b64encode(png).decode("ascii")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #999;padding:3px 8px;text-align:right}}th{{background:#eee}}img{{max-width:100%}}</style>
</head><body>
<h1>{html.escape(title)}</h1>
<table>{"".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in facts)}</table>
<h2>Recoveries</h2>
<table><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in head)}</tr>
{body or '<tr><td colspan="10">no recovery</td></tr>'}</table>
<h2>Panels</h2>
<img alt="loss, throughput, recovery timeline, heartbeat lag, checkpoint times" src="data:image/png;base64,{image}">
</body></html>
"""
