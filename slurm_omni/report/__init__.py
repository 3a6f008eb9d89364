"""``omni report``: summary, plots, HTML and Prometheus textfile from the files a run leaves behind.

The manager writes the recovery timeline with :func:`timeline_json` (format in ``timeline``);
``omni report`` and ``bench/goodput`` read it with :func:`load_timeline`.
"""

from slurm_omni.report.timeline import Recovery, ReportInputError, Timeline, load_timeline, timeline_json

__all__ = ["Recovery", "ReportInputError", "Timeline", "load_timeline", "timeline_json"]
