"""``omni report``: PNG, HTML, text summary, JSON lines and a Prometheus textfile from a run's files."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("-m", "--metrics", "metrics", type=click.Path(path_type=Path), multiple=True, required=True,
              help="Metrics folder (OMNI_METRICS_DIR: metrics-*.jsonl) or file; may repeat.")
@click.option("-r", "--reference", "reference", type=click.Path(path_type=Path), multiple=True,
              help="Metrics of a reference run that never failed (folder or file); may repeat.")
@click.option("--heartbeats", type=click.Path(path_type=Path), help="Heartbeat folder (OMNI_HEARTBEAT_DIR).")
@click.option("--timeline", type=click.Path(path_type=Path),
              help="Recovery timeline JSON the manager wrote (format: slurm_omni/report/timeline.py).")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder for report.png, report.html, summary.txt, summary.jsonl, omni-report.prom.")
@click.option("--prom", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the Prometheus textfile here instead (e.g. node_exporter's textfile folder).")
@click.option("--job-id", default="", help="Job id for labels when no timeline names it.")
@click.option("--title", default="", help="Title of the PNG and the page.")
def report(metrics: tuple[Path, ...], reference: tuple[Path, ...], heartbeats: Path | None, timeline: Path | None,
           out_dir: Path, prom: Path | None, job_id: str, title: str) -> None:
    """Summarize a run: loss across failures against a reference, throughput, recovery timeline,
    heartbeat lag, checkpoint times. Prints the summary table; writes all files or none."""
    from slurm_omni.report.build import build_report, report_files, write_all

    built = build_report(list(metrics), reference=list(reference), heartbeats=heartbeats, timeline=timeline,
                         job_id=job_id, title=title)
    files = report_files(built, out_dir, prom=prom)
    write_all(files)
    click.echo(built.text)
    click.echo("wrote " + ", ".join(str(p) for p in files))
