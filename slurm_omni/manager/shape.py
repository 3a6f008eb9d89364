"""A registered job's stages seen as placement units, and the job file of a resized incarnation.

The planner (policy/placement.py) moves whole units: one unit holds ``nodes / g`` nodes of every
stage, where ``g`` is the greatest common divisor of the stages' node counts, and ``dp / g``
data-parallel replicas (every stage holds one rank per replica). Shrinking or growing by units
keeps tasks per node fixed, so a resized incarnation is the same job file with fewer or more
nodes per stage and ``data_parallel_size`` to match.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from slurm_omni.config.job import JobFile
from slurm_omni.config.site import SiteConfig, parse_gres
from slurm_omni.errors import ConfigError
from slurm_omni.formats.registry import RegisteredStage
from slurm_omni.policy.placement import ComponentLayout, JobLayout, PlacementConfig, Plan
from slurm_omni.slurm.hostlist import expand


@dataclass(frozen=True, slots=True)
class Shape:
    stages: tuple[RegisteredStage, ...]
    data_parallel_size: int            # replicas as registered

    @property
    def units(self) -> int:
        """Placement units as registered."""
        return math.gcd(*(s.nodes for s in self.stages))

    @property
    def replicas_per_unit(self) -> int:
        return self.data_parallel_size // self.units

    def nodes_per_unit(self, stage: RegisteredStage) -> int:
        return stage.nodes // self.units

    def data_parallel_size_for(self, units: int) -> int:
        return units * self.replicas_per_unit

    def layout(self, nodes_by_offset: Mapping[int, Sequence[str]], units: int) -> JobLayout:
        """The planner's view of an incarnation with ``units`` units running on these nodes."""
        return JobLayout(
            components=tuple(ComponentLayout(s.het_group, tuple(nodes_by_offset.get(s.het_group, ())),
                                             self.nodes_per_unit(s), s.partition, (parse_gres(s.gres),))
                             for s in self.stages),
            units=units, target_units=self.units)

    def resized(self, job: JobFile, units: int) -> JobFile:
        """The job file of an incarnation with ``units`` units (same tasks per node)."""
        if len(job.stages) != len(self.stages):
            raise ConfigError(f"manager: couldn't resize {job.job.name}: the job file has {len(job.stages)} "
                              f"stages, the registration {len(self.stages)}")
        stages = [replace(s, nodes=units * self.nodes_per_unit(shape), tasks_per_node=shape.tasks_per_node)
                  for s, shape in zip(job.stages, self.stages, strict=True)]
        return replace(job, job=replace(job.job, data_parallel_size=self.data_parallel_size_for(units)),
                       stages=stages)

    def pinned(self, job: JobFile, plan: Plan) -> JobFile:
        """The job file of a submission pinned to ``plan``'s nodes (``--nodelist`` per component):
        each stage asks ``--switches`` for the leaf switches its nodes span. The job file's count
        would hold a replacement on another leaf up to ``switch_wait`` for a placement that no longer
        exists; a stage whose plan names no nodes or no leaf keeps the job file's count."""
        spans = {c.het_offset: c.leaf_switches for c in plan.components if c.nodes and c.leaf_switches}
        if len(job.stages) != len(self.stages):
            raise ConfigError(f"manager: couldn't pin {job.job.name}: the job file has {len(job.stages)} "
                              f"stages, the registration {len(self.stages)}")
        return replace(job, stages=[replace(s, switches=spans.get(shape.het_group, s.switches))
                                    for s, shape in zip(job.stages, self.stages, strict=True)])

    def placement_config(self, site: SiteConfig, job: JobFile | None) -> PlacementConfig:
        """The site's elasticity table in units; a unit count must cut the global batch evenly."""
        e = site.elasticity
        min_units = max(1, -(-e.min_data_parallel_size // self.replicas_per_unit))
        divides = 0
        if job is not None:
            per_unit = self.replicas_per_unit * job.training.parallel.micro_batch_size
            total = job.training.parallel.global_batch_size
            divides = total // per_unit if total % per_unit == 0 else 0
        while divides and divides % min_units:
            min_units += 1
        return PlacementConfig(min_units=min_units, spare_wait_s=e.spare_wait_s,
                               quarantine_s=e.quarantine_s, drain_failed=e.drain_failed, units_divide=divides,
                               spare_scope=e.spare_policy,
                               spare_nodes=tuple(expand(e.spare_nodes)) if e.spare_nodes else ())
