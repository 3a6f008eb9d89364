"""Read every input, build every output in memory, then write them all or none.

Outputs go to temporary names in their folders first and are renamed only once all of them were
written, so a bad input or a failed write leaves nothing half-done (and an older report intact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from slurm_omni.errors import OmniError
from slurm_omni.fsio import write_atomic
from slurm_omni.report.inputs import HeartbeatRecord, load_heartbeats, load_metrics, stage_names
from slurm_omni.report.render import html_page, prom_text, summary_json, text_table
from slurm_omni.report.summary import ReportSummary, step_points, summarize_points
from slurm_omni.report.timeline import Recovery, load_timeline


@dataclass(frozen=True, slots=True)
class Report:
    summary: ReportSummary
    text: str
    png: bytes
    html: str
    prom: str
    json: str


def build_report(metrics: Sequence[Path], *, reference: Sequence[Path] = (), heartbeats: Path | None = None,
                 timeline: Path | None = None, job_id: str = "", title: str = "") -> Report:
    records = load_metrics(metrics)
    names = stage_names(records)
    points = step_points(records)
    ref_points = step_points(load_metrics(reference)) if reference else []
    recoveries: list[Recovery] | None = list(load_timeline(timeline).recoveries) if timeline else None
    beats: list[HeartbeatRecord] = load_heartbeats(heartbeats) if heartbeats else []
    if not job_id and recoveries:
        job_id = recoveries[0].job_id
    summary = summarize_points(points, reference=ref_points, recoveries=recoveries, job_id=job_id, stages=names)
    text = text_table(summary)
    title = title or f"slurm-omni run report: job {summary.job_id or '?'}"
    from slurm_omni.report.plot import render_png  # matplotlib takes a second to import

    png = render_png(points, ref_points,
                     recoveries if recoveries is not None else [], beats, text, title=title, stage_names=names)
    return Report(summary, text, png, html_page(summary, png, title=title), prom_text(summary),
                  summary_json(summary))


def write_all(files: dict[Path, bytes]) -> None:
    """Replace each file at once (a reader sees the old report file or the whole new one); every
    folder is made first, so that a bad output path writes nothing."""
    try:
        for path in files:
            path.parent.mkdir(parents=True, exist_ok=True)
        for path, data in files.items():
            write_atomic(path, data, mode=0o644, durable=False)
    except OSError as e:
        raise OmniError(f"report: couldn't write {e.filename or 'outputs'}: {e.strerror}") from e


def report_files(report: Report, out_dir: Path, *, prom: Path | None = None) -> dict[Path, bytes]:
    return {
        out_dir / "report.png": report.png,
        out_dir / "report.html": report.html.encode(),
        out_dir / "summary.txt": (report.text + "\n").encode(),
        out_dir / "summary.jsonl": report.json.encode(),
        (prom or out_dir / "omni-report.prom"): report.prom.encode(),
    }
