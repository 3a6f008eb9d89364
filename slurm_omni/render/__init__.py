"""Batch scripts from a job file and the site config (jinja2 templates in ``sbatch_templates/``).

``HetJobRequest(...).materialize()`` returns the script; nothing in this package runs a command.
"""

from slurm_omni.render.request import ArrayJobRequest, DrillRequest, HetJobRequest, StagePlan, plan_stages

__all__ = ["ArrayJobRequest", "DrillRequest", "HetJobRequest", "StagePlan", "plan_stages"]
