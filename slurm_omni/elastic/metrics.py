"""Training metrics as JSON lines and as a Prometheus textfile, one of each per rank.

Files are named by stage and replica (``<stage>-<dp_rank>``, e.g. ``text-0``), not by rank, so that
one replica's history stays in one file when a resized run renumbers the ranks:

``<OMNI_METRICS_DIR>/metrics-<stage>-<dp_rank>.jsonl``: one object per logged step: ``time``, ``rank``,
``stage``, ``dp_rank``, ``incarnation`` and the values the script logged (``step``, ``loss``, ...);
the schema of the keys readers use is :class:`slurm_omni.formats.metrics.MetricsLine`, and every line
is checked against it before it is written (a wrong value raises one line naming the key).
``<OMNI_METRICS_DIR>/omni-<stage>-<dp_rank>.prom``: the latest numeric values as gauges ``omni_<key>``
labelled with job, rank, stage and dp_rank, written to a temporary name and renamed (node_exporter's
textfile collector convention) at the first step, then at most once per :data:`PROM_EVERY_S` and at
the end: a create and a rename per rank per step cost a parallel file system's metadata server in
proportion to the ranks (issue 19); a scrape every 15 s or more sees no difference. Replica 0 removes the textfiles of replicas that no longer exist.
``<OMNI_METRICS_DIR>/samples-<stage>-<dp_rank>.jsonl`` (with OMNI_TRACE_SAMPLES=1): the sample ids of
every step, ``{"step", "ids", "dp_rank", "incarnation"}``; ``omni demo`` checks them against a run
that never failed (every sample once, both stages in step).

Per node instead of per rank, where the heartbeat aggregates on the node (``elastic/heartbeat.py``,
``OMNI_HEARTBEAT_NODE_DIR``, the default under Slurm): each line, naming its file (``"file"``), goes
to the node-local folder, and the node's heartbeat leader appends the node's new lines to
``<OMNI_METRICS_DIR>/node-<NODE>.jsonl`` once per heartbeat interval (``elastic/node_metrics.py``):
the shared file system sees a write per node per interval, not one per rank per step. What no leader
copied yet when the rank ends goes to its own ``metrics-<stage>-<dp_rank>.jsonl``; without a node
folder (or with ``OMNI_METRICS_PER_NODE=0``) every line does. The rank that reports the job's loss
(``direct``: replica 0 of the last stage) writes every line straight to its own file instead, so
that a node lost never takes a step of the loss with it: one file per job written every step,
whatever the ranks per node. Readers merge both (``formats.metrics.read_folder``).

The folder goes through the one ownership check (``slurm_omni.ownership``: ours, nobody else can
write it; made 0755 when missing so that node_exporter can read it) and is held open: every file is
opened relative to its descriptor without following links, and a file appended to must be a regular
file of ours with one name. A folder or file another user planted is one line and exit 78.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from slurm_omni.elastic.heartbeat import NodeRelay
from slurm_omni.elastic.node_metrics import NodeLines
from slurm_omni.errors import RuntimeLayoutError
from slurm_omni.formats import RecordRejected
from slurm_omni.formats.heartbeat import node_file_name
from slurm_omni.formats.metrics import check_line, dumps, read_folder
from slurm_omni.fsio import write_atomic
from slurm_omni.ownership import NotOwnedError, OwnDir, ensure_dir

log = logging.getLogger(__name__)

_GAUGE_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
PROM_EVERY_S = 10.0
"""The textfile is rewritten at most this often (and at the first step and the end)."""


class MetricsLog:
    def __init__(self, metrics_dir: Path, *, stage_name: str, stage: int, rank: int, dp_rank: int,
                 dp_size: int, incarnation: int, job_id: str, trace: bool = False,
                 help_text: Mapping[str, str] | None = None, relay: NodeRelay | None = None,
                 direct: bool = False) -> None:
        """``relay``: the heartbeat's node aggregation (None: every line to this rank's own file);
        ``direct``: this rank reports the job's loss (``Layout.reports_loss``): its lines go to its own
        file even with a relay, and it copies the node's other lines only when it leads."""
        try:
            self._dir = ensure_dir(metrics_dir, what="metrics", mode=0o755)
        except NotOwnedError as e:   # exit 78: no restart makes another user's folder ours
            raise NotOwnedError(f"elastic: {e} (OMNI_METRICS_DIR)") from None
        self.labels = {"rank": rank, "stage": stage, "dp_rank": dp_rank, "incarnation": incarnation}
        self.help = dict(help_text or {})
        self._prom_labels = f'job="{job_id}",rank="{rank}",stage="{stage_name}",dp_rank="{dp_rank}"'
        name = f"{stage_name}-{dp_rank}"
        self.jsonl_path = metrics_dir / f"metrics-{name}.jsonl"
        self.prom_path = metrics_dir / f"omni-{name}.prom"
        self.trace_path = metrics_dir / f"samples-{name}.jsonl"
        if dp_rank == 0:
            for old in os.listdir(self._dir.fd):
                stem, _, suffix = old.removesuffix(".prom").rpartition("-")
                if old.endswith(".prom") and stem == f"omni-{stage_name}" and suffix.isdigit() \
                        and int(suffix) >= dp_size:
                    os.unlink(old, dir_fd=self._dir.fd)
        self._prom_at: float | None = None
        self._prom_pending: Mapping[str, float | int | None] | None = None
        self._jsonl = self._append(self.jsonl_path.name)
        self._trace = self._append(self.trace_path.name) if trace else None
        self._relay = relay
        self._node: NodeLines | None = None
        if relay is not None:
            folder = OwnDir(os.dup(relay.folder.fd), relay.folder_path)
            try:
                self._node = NodeLines(folder, metrics=self._dir, node_file=node_file_name(relay.node),
                                       rank=rank, own=not direct)
                relay.lines = self._node
            except (OSError, NotOwnedError) as e:   # the node folder is gone or not ours: lines to our own file
                folder.close()
                log.warning("metrics: couldn't write on the node (%s); appending to %s", e, self.jsonl_path)

    def _append(self, name: str) -> IO[str]:
        try:
            fd = self._dir.open_append(name)
        except NotOwnedError as e:
            raise NotOwnedError(f"elastic: metrics: {e} (someone else put it there: remove it)") from None
        return open(fd, "a", buffering=1)

    def log_step(self, values: Mapping[str, float | int | None], *,
                 line_only: Mapping[str, float | str | None] | None = None) -> None:
        """One line; ``line_only`` values go into the line but not into the textfile's gauges (the
        startup times of a life, on its first line)."""
        record = {"time": time.time(), **self.labels, **values, **(line_only or {})}
        try:
            check_line(record, f"step {values.get('step')!r} to {self.jsonl_path}", "log")
        except RecordRejected as e:
            raise RuntimeLayoutError(f"elastic: {e}") from None
        if self._node is not None and self._node.own:
            try:
                self._node.append(dumps({**record, "file": self.jsonl_path.name}).encode())
            except OSError as e:   # /dev/shm full: this line and the rest to our own file
                log.warning("metrics: couldn't write on the node (%s); appending to %s", e, self.jsonl_path)
                self._close_node()
                self._jsonl.write(dumps(record))
        else:
            self._jsonl.write(dumps(record))
        now = time.monotonic()
        if self._prom_at is None or now - self._prom_at >= PROM_EVERY_S:
            self._prom_at, self._prom_pending = now, None
            self._write_prom(values)
        else:
            self._prom_pending = dict(values)

    def trace(self, step: int, sample_ids: list[int]) -> None:
        if self._trace is not None:
            self._trace.write(json.dumps({"step": step, "ids": [int(i) for i in sample_ids],
                                          "dp_rank": self.labels["dp_rank"],
                                          "incarnation": self.labels["incarnation"]}) + "\n")

    def _write_prom(self, values: Mapping[str, float | int | None]) -> None:
        lines = []
        keys = [k for k in self.help if k in values] + sorted(k for k in values if k not in self.help)
        for key in keys:
            value = values[key]
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not _GAUGE_NAME.fullmatch(key) or not math.isfinite(value):
                continue
            lines += [f"# HELP omni_{key} {self.help.get(key, 'Logged by the training script.')}",
                      f"# TYPE omni_{key} gauge", f"omni_{key}{{{self._prom_labels}}} {float(value)!r}"]
        write_atomic(self.prom_path, ("\n".join(lines) + "\n").encode(), mode=0o644, durable=False,
                     dir_fd=self._dir.fd)

    def _close_node(self) -> None:
        """What no leader copied of this rank's lines to its own file; its file on the node removed."""
        node, self._node = self._node, None
        if node is None:
            return
        if self._relay is not None and self._relay.lines is node:
            self._relay.lines = None
        self._jsonl.flush()
        try:
            node.close(self._jsonl.fileno())
        except (OSError, NotOwnedError) as e:   # its lines stay on the node for the next leader
            log.warning("metrics: couldn't finish the node's copy of %s: %s", self.jsonl_path, e)
        finally:
            node.folder.close()
        if self._relay is not None:
            try:
                self._relay.remove_if_last()
            except OSError:
                pass

    def close(self) -> None:
        if self._prom_pending is not None:   # the last step's values, not those of up to PROM_EVERY_S before
            self._write_prom(self._prom_pending)
            self._prom_pending = None
        self._close_node()
        self._jsonl.close()
        if self._trace is not None:
            self._trace.close()
        self._dir.close()


def read_jsonl(path: Path) -> list[dict[str, object]]:
    """All records of a metrics or trace file (tests and reports read them back); a metrics file's
    lines wherever they are (its own file and the node files of its folder, ``read_folder``)."""
    if path.name.startswith("metrics-") and path.parent.is_dir():
        lines = read_folder(path.parent).get(path.name, [])
        return [json.loads(text) for _, text in lines]
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
