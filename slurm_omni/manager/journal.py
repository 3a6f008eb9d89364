"""The manager's journal: SQLite in WAL mode, so that a manager killed at any moment and restarted
neither loses a recovery nor acts twice.

Tables: ``jobs`` (registered by their owner), ``incarnations`` (one per submission of a job, with
the unique tag that names it in Slurm), ``observations``, ``decisions``, ``actions`` and
``recoveries`` (one timeline per failed incarnation: fault, detected, confirmed, resubmitted,
running, first step after restore).

Actions are two-phase (``perform_once``): the action is recorded as *intended* under a unique key
before it is done and marked *done* with its result after. On restart an intended action is first
looked for in Slurm (``find_existing``: e.g. squeue/sacct for the incarnation's tag in the job name
or comment) and only done again when it is not there. Every write is one transaction with
``synchronous=FULL``; times are passed in by the caller (the manager's clock).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import logging
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import msgspec

from slurm_omni.errors import OmniError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
PHASES = ("fault", "detected", "confirmed", "resubmitted", "running", "first_step")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY, owner_uid INTEGER NOT NULL, spec TEXT NOT NULL, registered_at REAL NOT NULL,
    state TEXT NOT NULL DEFAULT 'active', global_step INTEGER, last_checkpoint_step INTEGER,
    heartbeat_at REAL, progress_at REAL);
CREATE TABLE IF NOT EXISTS incarnations (
    job TEXT NOT NULL REFERENCES jobs(name), number INTEGER NOT NULL, tag TEXT NOT NULL UNIQUE,
    layout TEXT NOT NULL, slurm_job_id TEXT, submitted_at REAL, started_at REAL, ended_at REAL,
    end_reason TEXT, PRIMARY KEY (job, number));
CREATE TABLE IF NOT EXISTS observations (
    id INTEGER PRIMARY KEY, job TEXT NOT NULL, incarnation INTEGER, time REAL NOT NULL,
    kind TEXT NOT NULL, key TEXT UNIQUE, payload TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY, job TEXT NOT NULL, incarnation INTEGER, time REAL NOT NULL,
    verdict TEXT NOT NULL, cause TEXT NOT NULL, payload TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS actions (
    key TEXT PRIMARY KEY, job TEXT NOT NULL, incarnation INTEGER, kind TEXT NOT NULL,
    payload TEXT NOT NULL, state TEXT NOT NULL CHECK (state IN ('intended', 'done', 'failed')),
    result TEXT, error TEXT, attempts INTEGER NOT NULL, intended_at REAL NOT NULL, done_at REAL);
CREATE TABLE IF NOT EXISTS recoveries (
    job TEXT NOT NULL, incarnation INTEGER NOT NULL, cause TEXT NOT NULL, nodes TEXT NOT NULL,
    fault_at REAL, detected_at REAL, confirmed_at REAL, resubmitted_at REAL, running_at REAL,
    first_step_at REAL, new_incarnation INTEGER, plan TEXT, path TEXT, detail TEXT,
    PRIMARY KEY (job, incarnation));
CREATE INDEX IF NOT EXISTS observations_job ON observations (job, time);
CREATE INDEX IF NOT EXISTS actions_state ON actions (state);
"""


_RECOVERY_COLUMNS = ("path", "detail")
"""``path``: the road the recovery took (policy/recovery.RecoveryPath); ``detail``: what the step
supervisor reported of an in-allocation relaunch (nodes removed and added, spares left)."""

JOB_STATES = ("active", "waiting", "done", "failed", "cancelled")
"""A job's states in the journal; the last three are final (``cancelled``: by scancel, not the manager)."""
ENDED_STATES = JOB_STATES[2:]


class JournalError(OmniError):
    """The journal cannot be opened, or a write breaks one of its rules."""


def to_json(obj: Any) -> str:
    """JSON of dataclasses (Decision, Plan...), enums, tuples, sets and mappings."""
    def plain(o: Any) -> Any:
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return {f.name: plain(getattr(o, f.name)) for f in dataclasses.fields(o)}
        if isinstance(o, msgspec.Struct):
            return plain(msgspec.to_builtins(o))
        if isinstance(o, enum.Enum):
            return o.value
        if isinstance(o, Mapping):
            return {str(k): plain(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [plain(v) for v in o]
        if isinstance(o, (set, frozenset)):
            return sorted(plain(v) for v in o)
        return o
    return json.dumps(plain(obj), sort_keys=True)


def incarnation_tag(job: str, number: int) -> str:
    """The unique name of incarnation ``number`` of ``job`` in Slurm (job name / comment)."""
    return f"omni.{job}.{number}"


def action_key(kind: str, job: str, incarnation: int) -> str:
    """E.g. ``resubmit:train-a:3``: the resubmission that creates incarnation 3."""
    return f"{kind}:{job}:{incarnation}"


@dataclass(frozen=True, slots=True)
class ActionRecord:
    key: str
    job: str
    incarnation: int | None
    kind: str
    payload: dict[str, Any]
    state: str                 # intended, done, failed
    result: str | None
    attempts: int
    intended_at: float = 0.0   # when the action was first journaled as intended
    fresh: bool = False        # intend() just created it: nothing can have been done yet


@dataclass(frozen=True, slots=True)
class Recovery:
    job: str
    incarnation: int           # the incarnation that failed
    cause: str
    nodes: tuple[str, ...]
    times: dict[str, float | None]    # phase -> time, for every name in PHASES
    new_incarnation: int | None
    plan: dict[str, Any] | None
    path: str | None = None
    detail: dict[str, Any] | None = None

    @property
    def complete(self) -> bool:
        return self.times["first_step"] is not None

    def durations(self) -> dict[str, float | None]:
        """Seconds from each phase to the next (``detected`` = fault -> detected...), and ``total``."""
        out: dict[str, float | None] = {}
        for a, b in itertools.pairwise(PHASES):
            ta, tb = self.times[a], self.times[b]
            out[b] = None if ta is None or tb is None else tb - ta
        start = self.times["fault"] if self.times["fault"] is not None else self.times["detected"]
        end = self.times["first_step"]
        out["total"] = None if start is None or end is None else end - start
        return out


class Journal:
    """One SQLite file; open it once per process. ``readonly`` for ``omni status``."""

    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        self.path = path
        try:
            if readonly:
                self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, timeout=10)
            else:
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                path.touch(mode=0o600, exist_ok=True)
                self._db = sqlite3.connect(path, isolation_level=None, timeout=10)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.executescript(_SCHEMA)
                self._add_columns()
                self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            self._db.execute("PRAGMA foreign_keys=ON")
            row = self._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        except sqlite3.Error as e:
            raise JournalError(f"journal: couldn't open {path}: {e}") from e
        if row is None or int(row[0]) != SCHEMA_VERSION:
            raise JournalError(f"journal: couldn't use {path}: schema version {row and row[0]} "
                               f"(this manager knows {SCHEMA_VERSION})")

    def _add_columns(self) -> None:
        """Columns added since schema version 1 (a journal written by an older manager lacks them)."""
        have = {r[1] for r in self._db.execute("PRAGMA table_info(recoveries)")}
        for column in _RECOVERY_COLUMNS:
            if column not in have:
                self._db.execute(f"ALTER TABLE recoveries ADD COLUMN {column} TEXT")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- jobs ---------------------------------------------------------------------------------------
    def register_job(self, name: str, owner_uid: int, spec: Mapping[str, Any], now: float) -> None:
        """Register ``name`` for ``owner_uid``; registering it again updates the spec (same owner only)."""
        with self._tx() as db:
            row = db.execute("SELECT owner_uid FROM jobs WHERE name = ?", (name,)).fetchone()
            if row is not None and row[0] != owner_uid:
                raise JournalError(f"journal: couldn't register job {name!r}: owned by uid {row[0]} "
                                   f"(pick another name)")
            db.execute("INSERT INTO jobs (name, owner_uid, spec, registered_at) VALUES (?, ?, ?, ?) "
                       "ON CONFLICT (name) DO UPDATE SET spec = excluded.spec, state = 'active'",
                       (name, owner_uid, to_json(spec), now))

    def jobs(self, owner_uid: int, *, states: tuple[str, ...] = ("active",)) -> list[dict[str, Any]]:
        """Jobs of ``owner_uid`` only: the manager acts on nothing its user did not register."""
        marks = ",".join("?" * len(states))
        rows = self._db.execute(f"SELECT name, spec, state, registered_at, global_step, last_checkpoint_step, "
                                f"heartbeat_at, progress_at FROM jobs WHERE owner_uid = ? AND state IN ({marks}) "
                                f"ORDER BY name", (owner_uid, *states)).fetchall()
        keys = ("name", "spec", "state", "registered_at", "global_step", "last_checkpoint_step",
                "heartbeat_at", "progress_at")
        return [{**dict(zip(keys, r, strict=True)), "spec": json.loads(r[1])} for r in rows]

    def set_job_state(self, name: str, state: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET state = ? WHERE name = ?", (state, name))

    def update_progress(self, name: str, *, global_step: int | None, last_checkpoint_step: int | None,
                        heartbeat_at: float | None, progress_at: float | None) -> None:
        """What ``omni status`` shows as progress and heartbeat lag (not journaled per heartbeat)."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET global_step = ?, last_checkpoint_step = ?, heartbeat_at = ?, "
                       "progress_at = ? WHERE name = ?",
                       (global_step, last_checkpoint_step, heartbeat_at, progress_at, name))

    # -- incarnations -------------------------------------------------------------------------------
    def add_incarnation(self, job: str, number: int, layout: Any) -> str:
        """Record incarnation ``number`` before it is submitted (idempotent); returns its tag."""
        tag = incarnation_tag(job, number)
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO incarnations (job, number, tag, layout) VALUES (?, ?, ?, ?)",
                       (job, number, tag, to_json(layout)))
        return tag

    def set_incarnation(self, job: str, number: int, **fields: Any) -> None:
        """Set slurm_job_id, submitted_at, started_at, ended_at or end_reason."""
        allowed = {"slurm_job_id", "submitted_at", "started_at", "ended_at", "end_reason"}
        if not fields or set(fields) - allowed:
            raise JournalError(f"journal: couldn't update incarnation: fields {sorted(fields)} "
                               f"(allowed: {', '.join(sorted(allowed))})")
        sets = ", ".join(f"{k} = ?" for k in sorted(fields))
        with self._tx() as db:
            db.execute(f"UPDATE incarnations SET {sets} WHERE job = ? AND number = ?",
                       (*(fields[k] for k in sorted(fields)), job, number))

    def incarnations(self, job: str) -> list[dict[str, Any]]:
        keys = ("number", "tag", "layout", "slurm_job_id", "submitted_at", "started_at", "ended_at", "end_reason")
        rows = self._db.execute(f"SELECT {', '.join(keys)} FROM incarnations WHERE job = ? ORDER BY number",
                                (job,)).fetchall()
        return [{**dict(zip(keys, r, strict=True)), "layout": json.loads(r[2])} for r in rows]

    # -- observations and decisions -----------------------------------------------------------------
    def record_observation(self, job: str, incarnation: int | None, kind: str, time: float, payload: Any,
                           key: str | None = None) -> bool:
        """Journal one observation; ``key`` (e.g. the event file's name) makes a re-read a no-op.
        Returns False when that key was journaled already."""
        with self._tx() as db:
            cur = db.execute("INSERT OR IGNORE INTO observations (job, incarnation, time, kind, key, payload) "
                             "VALUES (?, ?, ?, ?, ?, ?)", (job, incarnation, time, kind, key, to_json(payload)))
            return cur.rowcount == 1

    def has_observation(self, job: str, kind: str) -> bool:
        """Whether ``job`` has an observation of ``kind`` (any incarnation)."""
        return self._db.execute("SELECT 1 FROM observations WHERE job = ? AND kind = ? LIMIT 1",
                                (job, kind)).fetchone() is not None

    def observed_incarnations(self, job: str, kind: str) -> set[int]:
        """The incarnations of ``job`` that have an observation of ``kind``."""
        rows = self._db.execute("SELECT DISTINCT incarnation FROM observations WHERE job = ? AND kind = ? "
                                "AND incarnation IS NOT NULL", (job, kind)).fetchall()
        return {int(r[0]) for r in rows}

    def record_decision(self, job: str, incarnation: int | None, time: float, verdict: str, cause: str,
                        payload: Any) -> int:
        with self._tx() as db:
            cur = db.execute("INSERT INTO decisions (job, incarnation, time, verdict, cause, payload) "
                             "VALUES (?, ?, ?, ?, ?, ?)", (job, incarnation, time, verdict, cause, to_json(payload)))
            return int(cur.lastrowid or 0)

    def decisions(self, job: str, verdict: str) -> list[dict[str, Any]]:
        """Decisions of ``job`` with ``verdict``, oldest first, payloads parsed."""
        rows = self._db.execute("SELECT incarnation, time, cause, payload FROM decisions WHERE job = ? AND verdict = ? "
                                "ORDER BY id", (job, verdict)).fetchall()
        return [{"incarnation": r[0], "time": r[1], "cause": r[2], "payload": json.loads(r[3]) if r[3] else None}
                for r in rows]

    def count(self, table: str, job: str) -> int:
        if table not in ("observations", "decisions", "actions", "incarnations", "recoveries"):
            raise JournalError(f"journal: couldn't count {table!r}: no such table")
        return int(self._db.execute(f"SELECT COUNT(*) FROM {table} WHERE job = ?", (job,)).fetchone()[0])

    # -- two-phase actions --------------------------------------------------------------------------
    def intend(self, key: str, job: str, incarnation: int | None, kind: str, payload: Any,
               now: float) -> ActionRecord:
        """Record the action as intended, or return the record already there (``fresh`` False).
        A failed action is intended again (its attempt count grows)."""
        with self._tx() as db:
            cur = db.execute("INSERT OR IGNORE INTO actions (key, job, incarnation, kind, payload, state, "
                             "attempts, intended_at) VALUES (?, ?, ?, ?, ?, 'intended', 1, ?)",
                             (key, job, incarnation, kind, to_json(payload), now))
            fresh = cur.rowcount == 1
            if not fresh:
                db.execute("UPDATE actions SET state = 'intended', attempts = attempts + 1, error = NULL "
                           "WHERE key = ? AND state = 'failed'", (key,))
        record = self.action(key)
        if record is None:
            raise JournalError(f"journal: couldn't read back action {key!r}")
        return dataclasses.replace(record, fresh=fresh)

    def mark_done(self, key: str, result: str, now: float) -> None:
        with self._tx() as db:
            cur = db.execute("UPDATE actions SET state = 'done', result = ?, done_at = ? WHERE key = ? "
                             "AND state = 'intended'", (result, now, key))
            if cur.rowcount != 1:
                raise JournalError(f"journal: couldn't mark action {key!r} done: not intended")

    def mark_failed(self, key: str, error: str, now: float) -> None:
        """The action's attempt ended in an error; it may or may not have taken effect."""
        with self._tx() as db:
            db.execute("UPDATE actions SET state = 'failed', error = ?, done_at = ? WHERE key = ? "
                       "AND state = 'intended'", (error[:2000], now, key))

    def action(self, key: str) -> ActionRecord | None:
        row = self._db.execute("SELECT key, job, incarnation, kind, payload, state, result, attempts, "
                               "intended_at FROM actions WHERE key = ?", (key,)).fetchone()
        return None if row is None else ActionRecord(row[0], row[1], row[2], row[3], json.loads(row[4]),
                                                     row[5], row[6], row[7], float(row[8]))

    def pending_actions(self) -> list[ActionRecord]:
        """Intended or failed actions not known to be done: what a restarted manager reconciles."""
        keys = [r[0] for r in self._db.execute(
            "SELECT key FROM actions WHERE state IN ('intended', 'failed') ORDER BY intended_at, key")]
        return [a for a in (self.action(k) for k in keys) if a is not None]

    # -- recovery timelines -------------------------------------------------------------------------
    def open_recovery(self, job: str, incarnation: int, cause: str, nodes: tuple[str, ...], *,
                      fault_at: float | None, detected_at: float | None, confirmed_at: float | None,
                      path: str | None = None) -> Recovery:
        """The timeline of incarnation ``incarnation``'s failure; opening it again changes nothing."""
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO recoveries (job, incarnation, cause, nodes, fault_at, "
                       "detected_at, confirmed_at, path) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (job, incarnation, cause, json.dumps(list(nodes)), fault_at, detected_at, confirmed_at,
                        path))
        found = self.recovery(job, incarnation)
        if found is None:
            raise JournalError(f"journal: couldn't read back recovery of {job} incarnation {incarnation}")
        return found

    def mark_phase(self, job: str, incarnation: int, phase: str, at: float, *,
                   new_incarnation: int | None = None, plan: Any = None, path: str | None = None,
                   detail: Mapping[str, Any] | None = None) -> None:
        """Set a phase time once (the first report wins); also the new incarnation, its plan, the
        recovery's path (the manager's takeover changes it) and the supervisor's detail."""
        if phase not in PHASES:
            raise JournalError(f"journal: couldn't mark phase {phase!r} (allowed: {', '.join(PHASES)})")
        col = f"{phase}_at"
        with self._tx() as db:
            db.execute(f"UPDATE recoveries SET {col} = COALESCE({col}, ?) WHERE job = ? AND incarnation = ?",
                       (at, job, incarnation))
            if new_incarnation is not None:
                db.execute("UPDATE recoveries SET new_incarnation = ? WHERE job = ? AND incarnation = ?",
                           (new_incarnation, job, incarnation))
            if plan is not None:
                db.execute("UPDATE recoveries SET plan = ? WHERE job = ? AND incarnation = ?",
                           (to_json(plan), job, incarnation))
            if path is not None:
                db.execute("UPDATE recoveries SET path = ? WHERE job = ? AND incarnation = ?",
                           (path, job, incarnation))
            if detail is not None:
                db.execute("UPDATE recoveries SET detail = ? WHERE job = ? AND incarnation = ?",
                           (to_json(detail), job, incarnation))

    def recovery(self, job: str, incarnation: int) -> Recovery | None:
        rows = self._recoveries("WHERE job = ? AND incarnation = ?", (job, incarnation))
        return rows[0] if rows else None

    def recoveries(self, job: str) -> list[Recovery]:
        return self._recoveries("WHERE job = ? ORDER BY incarnation", (job,))

    def open_recoveries(self) -> list[Recovery]:
        """Recoveries without a first step after restore: a restarted manager carries them on."""
        return self._recoveries("WHERE first_step_at IS NULL ORDER BY job, incarnation", ())

    def _recoveries(self, where: str, args: tuple[Any, ...]) -> list[Recovery]:
        cols = ", ".join(f"{p}_at" for p in PHASES)
        have = {r[1] for r in self._db.execute("PRAGMA table_info(recoveries)")}
        extra = ", ".join(c if c in have else "NULL" for c in _RECOVERY_COLUMNS)   # a read-only older journal
        rows = self._db.execute(f"SELECT job, incarnation, cause, nodes, {cols}, new_incarnation, plan, {extra} "
                                f"FROM recoveries {where}", args).fetchall()
        return [Recovery(r[0], r[1], r[2], tuple(json.loads(r[3])), dict(zip(PHASES, r[4:10], strict=True)),
                         r[10], None if r[11] is None else json.loads(r[11]), r[12],
                         None if r[13] is None else json.loads(r[13])) for r in rows]

    # -- the view of ``omni status --json`` -------------------------------------------------------------
    def status(self, owner_uid: int, now: float) -> list[dict[str, Any]]:
        out = []
        for job in self.jobs(owner_uid, states=JOB_STATES):
            hb = job["heartbeat_at"]
            out.append({**job, "heartbeat_lag_s": None if hb is None else max(0.0, now - hb),
                        "incarnations": self.incarnations(job["name"]),
                        "recoveries": [{"incarnation": r.incarnation, "cause": r.cause, "nodes": list(r.nodes),
                                        "new_incarnation": r.new_incarnation, "times": r.times,
                                        "durations": r.durations(), "complete": r.complete, "path": r.path,
                                        "plan": r.plan, "detail": r.detail}
                                       for r in self.recoveries(job["name"])]})
        return out


def perform_once(journal: Journal, *, key: str, job: str, incarnation: int | None, kind: str, payload: Any,
                 now: Callable[[], float], act: Callable[[], str],
                 find_existing: Callable[[ActionRecord], str | None]) -> str:
    """Do ``act`` at most once for ``key`` across manager restarts; returns its result (e.g. the
    Slurm job id). An action intended by an earlier run is first looked for with
    ``find_existing`` (given the intent's record: only a submission made after ``intended_at`` can
    be the action's) and adopted when found."""
    record = journal.intend(key, job, incarnation, kind, payload, now())
    if record.state == "done" and record.result is not None:
        return record.result
    if not record.fresh:
        found = find_existing(record)
        if found is not None:
            log.info("journal: action %s was done before a restart (%s); adopting it", key, found)
            journal.mark_done(key, found, now())
            return found
    try:
        result = act()
    except Exception as e:
        journal.mark_failed(key, str(e), now())
        raise
    journal.mark_done(key, result, now())
    return result
