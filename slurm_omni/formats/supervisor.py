"""The files between the step supervisor and the manager, one schema each, shared by writer and reader.

All live in the job's checkpoint folder, ``<ckpt>/supervisor/`` (:data:`SUBDIR`):

``<run>.jsonl``: the supervisor's journal (``supervisor/journal.py``), one :data:`JournalRecord`
per line, appended and fsynced before the supervisor acts on it; the tag ``kind`` says which. The
supervisor replays it when it starts again; the manager reads the ``request`` records (the answer
to its request). ``<run>`` is the allocation's run (:func:`allocation_run`): the Slurm job id,
``<job id>.<restart count>`` after a requeue. A
line that does not match (a torn last line after a crash) is skipped with one line of log. Keys a
record does not know are ignored (a newer supervisor may add some): the journal outlives upgrades.

``<run>.status.json``: :class:`SupervisorStatus`, replaced atomically on every change: where the
job stands (``omni status``, the manager's fail-slow requests and its check that the supervisor is
alive, the demo). Unknown keys are ignored, the known ones checked strictly.

``<slurm job id>.request.json``: :class:`SupervisorRequest`, written by the manager (a fail-slow
replacement at the next checkpoint), read by the supervisor, which journals its answer once per id.
Keys are closed.

``relaunched-<incarnation after>.json`` / ``gave_up-<incarnation after>.json``:
:class:`SupervisorReport`, one per recovery inside the allocation, written by the supervisor and
read by the manager (``manager/supervisor_reports.py``) into the recovery table's
``SupervisorReport``. Keys are closed.

Writers use ``encode`` + ``fsio.write_atomic``; readers ``fsio.read_bounded`` + ``decode``: any
malformed file is one ``RecordRejected`` line for the reader to log and skip. Recorded examples:
tests/fixtures/supervisor/.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from slurm_omni.formats import RecordRejected, decode, encode
from slurm_omni.fsio import one_line

SUBDIR = "supervisor"
MAX_JOURNAL_BYTES = 4 << 20
MAX_JOURNAL_LINE_BYTES = 64 * 1024
MAX_STATUS_BYTES = 1 << 20
MAX_REQUEST_BYTES = 64 * 1024
MAX_REPORT_BYTES = 64 * 1024

Node = Annotated[str, msgspec.Meta(pattern=r"^[!-~]{1,255}$")]
"""A Slurm node name: 1 to 255 printable ASCII characters, no blank."""
Count = Annotated[int, msgspec.Meta(ge=0)]
Time = Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)]
"""Unix time (a fake clock's small numbers too)."""
Text = Annotated[str, msgspec.Meta(max_length=2000)]
JobId = Annotated[str, msgspec.Meta(pattern=r"^[0-9]{1,20}$")]
ExitCode = Annotated[int, msgspec.Meta(ge=-1, le=255)]
"""A step's exit code; -1: unknown (an adopted srun that was gone)."""
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
RequestId = Annotated[str, msgspec.Meta(pattern=r"^[!-~]{1,128}$")]
RequestOutcome = Literal["accepted", "no_spare", "below_minimum", "unknown_node", "carried_out"]
REQUEST_OUTCOMES: tuple[RequestOutcome, ...] = ("accepted", "no_spare", "below_minimum", "unknown_node",
                                                "carried_out")
SupervisorPhase = Literal["waiting", "launching", "running", "stopping", "confirming", "ended", "relaunching",
                          "shrinking", "done", "stopped", "fallback"]
"""The status file's phase: the supervisor's lifecycle (``policy.supervisor_lifecycle.Phase``, where
each is explained): ``waiting`` (allocation mode: for the allocation to start), ``launching``,
``running``, ``stopping`` (the step asked to checkpoint), ``confirming`` (a failure confirmed, the
step being killed), ``ended`` (planning the recovery), ``relaunching``, ``shrinking`` (relaunching
with fewer placement units), and the ends: ``done``
(training finished), ``stopped`` (asked to, the allocation ending, or bad input) and ``fallback``
(handed over to the manager's resubmission)."""
SUPERVISOR_PHASES: tuple[SupervisorPhase, ...] = ("waiting", "launching", "running", "stopping", "confirming", "ended",
                                                  "relaunching", "shrinking", "done", "stopped", "fallback")
ReportKind = Literal["relaunched", "gave_up"]
REPORT_KINDS: tuple[ReportKind, ...] = ("relaunched", "gave_up")


def allocation_run(slurm_job_id: str, restart_count: int = 0) -> str:
    """One run of an allocation, what its supervisor's journal and status file are named by: the
    Slurm job id, with Slurm's restart count after a requeue (the same job id runs again)."""
    return slurm_job_id if not restart_count else f"{slurm_job_id}.{restart_count}"


def journal_path(ckpt_dir: Path, run: str) -> Path:
    return ckpt_dir / SUBDIR / f"{run}.jsonl"


def status_path(ckpt_dir: Path, run: str) -> Path:
    return ckpt_dir / SUBDIR / f"{run}.status.json"


def request_path(ckpt_dir: Path, slurm_job_id: str) -> Path:
    return ckpt_dir / SUBDIR / f"{slurm_job_id}.request.json"


def report_path(ckpt_dir: Path, kind: ReportKind, incarnation_after: int) -> Path:
    return ckpt_dir / SUBDIR / f"{kind}-{incarnation_after}.json"


# -- the journal ------------------------------------------------------------------------------------
class LayoutRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A launch's placement (``policy.in_allocation.StepLayout``)."""

    components: list[list[Node]]
    """Per heterogeneous component (stage), its nodes."""
    spares: list[Node] = msgspec.field(default_factory=list)
    failed: list[Node] = msgspec.field(default_factory=list)
    units: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Placement units the launch runs (each ``replicas_per_unit`` data-parallel replicas)."""
    kind_of: dict[Node, Annotated[str, msgspec.Meta(max_length=255)]] = msgspec.field(default_factory=dict)


class _Line(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    time: Time


class AllocationRecord(_Line, frozen=True, kw_only=True, tag="allocation"):
    nodes: list[Node]


class LaunchRecord(_Line, frozen=True, kw_only=True, tag="launch"):
    """The intent, journaled before its srun starts."""

    launch: Count
    layout: LayoutRecord
    data_parallel_size: Annotated[int, msgspec.Meta(ge=1)]
    port: Port
    incarnation: Count
    """The launch's OMNI_INCARNATION (the allocation's plus the launch number)."""
    ports_taken: list[Port] = msgspec.field(default_factory=list)
    cause: Text = ""
    removed: list[Node] = msgspec.field(default_factory=list)
    added: list[Node] = msgspec.field(default_factory=list)
    allocation: Annotated[str, msgspec.Meta(max_length=255)] = ""
    """Allocation mode: the Slurm job id of the allocation it runs in when that is a successor
    allocation (empty: the job's first); from this launch on the successor is the job's allocation."""
    end_time: Time | None = None
    """That allocation's time limit (Unix time), when ``allocation`` is set."""


class SrunRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One more srun of a launch that spans allocations (``slurm.steps.span_argvs``)."""

    job: JobId
    """The allocation it runs in (a pool's job id)."""
    pid: Annotated[int, msgspec.Meta(gt=0)]
    pid_start: Count = 0


class LaunchedRecord(_Line, frozen=True, kw_only=True, tag="launched"):
    launch: Count
    pid: Annotated[int, msgspec.Meta(gt=0)]
    pid_start: Count = 0
    """The srun's start time (clock ticks after boot; 0: unknown)."""
    extra: list[SrunRecord] = msgspec.field(default_factory=list)
    """A launch across allocations: its sruns in the pools (``pid`` runs the first)."""


class EndedRecord(_Line, frozen=True, kw_only=True, tag="ended"):
    launch: Count
    rc: ExitCode


class SignalRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One level-1 signal a confirmation rests on (``policy.confirm.Level1Signal``): what, where, who
    said it (slurm, srun, task, step, heartbeat) and when the supervisor heard it."""

    kind: Annotated[str, msgspec.Meta(max_length=32)]
    node: Annotated[str, msgspec.Meta(max_length=255)] = ""
    source: Annotated[str, msgspec.Meta(max_length=32)] = ""
    at: Time


class ConfirmedRecord(_Line, frozen=True, kw_only=True, tag="confirmed"):
    """The confirmation rule's verdict on what a launch left (``policy.confirm``)."""

    launch: Count
    cause: Text
    nodes: list[Node] = msgspec.field(default_factory=list)
    rc: ExitCode = 0
    fault_at: Time | None = None
    detected_at: Time | None = None
    confirmed_at: Time | None = None
    reasons: list[Text] = msgspec.field(default_factory=list)
    signals: list[SignalRecord] = msgspec.field(default_factory=list)
    """The level-1 signals the verdict rests on, in the order they were heard (at most 16)."""


class RequestRecord(_Line, frozen=True, kw_only=True, tag="request"):
    """The supervisor's answer to a request (the manager reads it: ``request_outcome``)."""

    id: RequestId
    replace: list[Node]
    outcome: RequestOutcome
    launch: Count
    shrink: bool = False


class FallbackRecord(_Line, frozen=True, kw_only=True, tag="fallback"):
    launch: Count
    failed_nodes: list[Node] = msgspec.field(default_factory=list)
    reasons: list[Text] = msgspec.field(default_factory=list)


class DoneRecord(_Line, frozen=True, kw_only=True, tag="done"):
    launch: Count


class FirstStepRecord(_Line, frozen=True, kw_only=True, tag="first_step"):
    launch: Count
    at: Time
    step: Annotated[int, msgspec.Meta(ge=-1)]


class LaunchFailedRecord(_Line, frozen=True, kw_only=True, tag="start_failure"):
    """The launch failed before its first heartbeat (``policy/start_failure.py``)."""

    launch: Count
    exit_code: Annotated[int, msgspec.Meta(ge=0, le=255)]
    line: Text
    log: Annotated[str, msgspec.Meta(max_length=4096)]


class PoolRecord(_Line, frozen=True, kw_only=True, tag="pool"):
    """A pool allocation's step in its life (``policy/pools.py``): ``asking`` (its salloc about to
    start), ``requested`` (Slurm's job id), ``granted`` (its nodes), ``ended``, ``released``."""

    event: Literal["asking", "requested", "granted", "ended", "released"]
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    job: Annotated[str, msgspec.Meta(max_length=255)] = ""
    """Its Slurm job id (empty until known; comma-separated when found by name)."""
    nodes: list[Node] = msgspec.field(default_factory=list)
    kind_of: dict[Node, Annotated[str, msgspec.Meta(max_length=255)]] = msgspec.field(default_factory=dict)
    nodes_asked: Count = 0
    state: Annotated[str, msgspec.Meta(max_length=64)] = ""
    """Slurm's state of a pool that ended."""
    reason: Text = ""


class SuccessorRecord(_Line, frozen=True, kw_only=True, tag="successor"):
    """The time limit's successor allocation (``policy/pools.py``): asked for ``after`` the allocation
    the job runs in: ``asking`` (its salloc about to start), ``requested`` (Slurm's job id),
    ``granted`` (its nodes, its time limit), ``ended`` (Slurm ended it before it was used),
    ``released`` (the supervisor gave it back unused). A launch journaled with its job id as
    ``allocation`` is the move onto it."""

    event: Literal["asking", "requested", "granted", "ended", "released"]
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    after: Annotated[str, msgspec.Meta(max_length=255)]
    """The job id of the allocation it succeeds."""
    job: Annotated[str, msgspec.Meta(max_length=255)] = ""
    nodes: list[Node] = msgspec.field(default_factory=list)
    end_time: Time | None = None
    state: Annotated[str, msgspec.Meta(max_length=64)] = ""
    reason: Text = ""


JournalRecord = (AllocationRecord | LaunchRecord | LaunchedRecord | EndedRecord | ConfirmedRecord | RequestRecord
                 | FallbackRecord | DoneRecord | FirstStepRecord | LaunchFailedRecord | PoolRecord | SuccessorRecord)
JOURNAL_KINDS: tuple[str, ...] = tuple(str(t.__struct_config__.tag) for t in JournalRecord.__args__)


def encode_journal_line(record: JournalRecord) -> bytes:
    return encode(record)


def decode_journal_line(data: bytes, what: str) -> JournalRecord:
    if len(data) > MAX_JOURNAL_LINE_BYTES:
        raise RecordRejected(f"couldn't accept {what}: {len(data)} bytes (at most {MAX_JOURNAL_LINE_BYTES})")
    return decode(data, JournalRecord, what)  # type: ignore[arg-type]


def journal_record(kind: str, time: float, fields: dict[str, object], what: str) -> JournalRecord:
    """The record the journal writer appends, checked against its schema before it is written: a
    kind or a key the schema does not have is refused too (the reader would drop the key)."""
    def refused(why: str) -> RecordRejected:
        return RecordRejected(f"couldn't journal {one_line(kind, 40)!r} in {what}: {one_line(why)} (records: "
                              f"{', '.join(JOURNAL_KINDS)}; slurm_omni/formats/supervisor.py)")
    try:
        rec: JournalRecord = msgspec.convert({"kind": kind, "time": time, **fields}, JournalRecord, strict=True)
    except msgspec.ValidationError as e:
        raise refused(str(e)) from None
    unknown = sorted(set(fields) - set(type(rec).__struct_fields__))
    if unknown:
        raise refused(f"no key {unknown[0]!r} in a {kind} record")
    return rec


# -- the status file --------------------------------------------------------------------------------
class StatusRecovery(msgspec.Struct, frozen=True, kw_only=True):
    """One recovery inside the allocation, as ``omni status`` and the demo show it."""

    path: Literal["in_allocation"] = "in_allocation"
    slurm_job_id: JobId
    slurm_job_id_after: JobId
    launch: Count
    """The launch it started."""
    cause: Text = ""
    removed: list[Node] = msgspec.field(default_factory=list)
    added: list[Node] = msgspec.field(default_factory=list)
    data_parallel_size_before: Annotated[int, msgspec.Meta(ge=1)]
    data_parallel_size_after: Annotated[int, msgspec.Meta(ge=1)]
    spares_left: Count = 0
    fault_at: Time | None = None
    confirmed_at: Time | None = None
    relaunched_at: Time | None = None
    first_step_at: Time | None = None


class StatusPool(msgspec.Struct, frozen=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(max_length=255)]
    slurm_job_id: Annotated[str, msgspec.Meta(max_length=255)] = ""
    state: Literal["asking", "requested", "granted", "ended", "released"]
    nodes: list[Node] = msgspec.field(default_factory=list)


class SupervisorStatus(msgspec.Struct, frozen=True, kw_only=True):
    path: Literal["in_allocation"] = "in_allocation"
    slurm_job_id: JobId
    phase: SupervisorPhase
    updated_at: Time
    launch: Count | None = None
    """The current launch (None before the first)."""
    data_parallel_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    components: list[list[Node]] = msgspec.field(default_factory=list)
    spares: list[Node] = msgspec.field(default_factory=list)
    spares_left: Count = 0
    failed_nodes: list[Node] = msgspec.field(default_factory=list)
    recoveries: list[StatusRecovery] = msgspec.field(default_factory=list)
    fallback: FallbackRecord | None = None
    """The journal's hand-over record, once the supervisor handed over."""
    pools: list[StatusPool] = msgspec.field(default_factory=list)
    """Pool allocations asked for (``policy/pools.py``), oldest first."""
    allocation: Annotated[str, msgspec.Meta(max_length=255)] = ""
    """Allocation mode: the Slurm job id of the allocation the job runs in now, when the job moved to a
    successor allocation at a time limit (empty: ``slurm_job_id``, the job's first). The manager
    watches, cancels and confirms node failures on it."""
    successor: StatusPool | None = None
    """The successor allocation asked for while this allocation runs (``policy/pools.py``)."""

    @property
    def allocations(self) -> tuple[str, ...]:
        """Every allocation the job holds now: the one it runs in, its granted pools, an open successor."""
        out = [self.allocation or self.slurm_job_id]
        out += [p.slurm_job_id for p in self.pools if p.state == "granted" and p.slurm_job_id]
        if self.successor is not None and self.successor.state in ("requested", "granted") and \
                self.successor.slurm_job_id:
            out.append(self.successor.slurm_job_id)
        return tuple(dict.fromkeys(out))

    @property
    def nodes(self) -> frozenset[str]:
        """The nodes the current launch runs on."""
        return frozenset(n for c in self.components for n in c)


def encode_status(status: SupervisorStatus) -> bytes:
    return encode(status)


def decode_status(data: bytes, what: str) -> SupervisorStatus:
    return decode(data, SupervisorStatus, what)


# -- the manager's request --------------------------------------------------------------------------
class SupervisorRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Leave ``replace`` at the next checkpoint: on spares, or (``shrink``) with fewer data-parallel
    replicas when no spare is left."""

    id: RequestId
    replace: Annotated[list[Node], msgspec.Meta(min_length=1)]
    at: Literal["checkpoint"] = "checkpoint"
    shrink: bool = False


def encode_request(request: SupervisorRequest) -> bytes:
    return encode(request)


def decode_request(data: bytes, what: str) -> SupervisorRequest:
    return decode(data, SupervisorRequest, what)


# -- the supervisor's reports -----------------------------------------------------------------------
class SupervisorReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One recovery inside the allocation (``relaunched``) or the hand-over (``gave_up``). Every key
    but version, kind, slurm_job_id and incarnation_after may be missing or null; at least one of
    relaunched_at, confirmed_at, detected_at is a time."""

    version: Literal[1] = 1
    kind: ReportKind
    slurm_job_id: JobId
    incarnation_before: Count | None = msgspec.field(default=None, name="life_before")
    incarnation_after: Count = msgspec.field(name="life_after")
    """The OMNI_INCARNATION of the launch that follows (``gave_up``: the one that would have)."""
    cause: Text | None = None
    nodes: list[Node] | None = None
    removed: dict[Annotated[str, msgspec.Meta(pattern=r"^[0-9]{1,4}$")], list[Node]] | None = None
    """Per het offset (stage index), the nodes the launch left."""
    added: dict[Annotated[str, msgspec.Meta(pattern=r"^[0-9]{1,4}$")], list[Node]] | None = None
    spares_left: dict[Annotated[str, msgspec.Meta(pattern=r"^[0-9]{1,4}$")], Count] | None = None
    data_parallel_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    fault_at: Time | None = None
    detected_at: Time | None = None
    confirmed_at: Time | None = None
    relaunched_at: Time | None = None
    reason: Text | None = None
    failed_nodes: list[Node] | None = None

    def __post_init__(self) -> None:
        if self.at is None:
            raise ValueError("no time (relaunched_at, confirmed_at or detected_at)")

    @property
    def at(self) -> float | None:
        """When it happened: relaunched, else confirmed, else detected."""
        return self.relaunched_at or self.confirmed_at or self.detected_at


def encode_report(report: SupervisorReport) -> bytes:
    return encode(report)


def decode_report(data: bytes, what: str) -> SupervisorReport:
    return decode(data, SupervisorReport, what)
