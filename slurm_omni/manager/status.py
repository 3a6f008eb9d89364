"""What ``omni status`` shows, and the recovery timeline file ``omni report`` reads
(slurm_omni/report/timeline.py: ``{"recoveries": [...]}``, replaced atomically)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slurm_omni.fsio import write_atomic
from slurm_omni.manager.journal import JOB_STATES, PHASES, Journal

# The confirmer's causes in the words of the timeline's "kind".
KINDS = {"down": "node_down", "fail": "node_fail", "not_responding": "node_not_responding",
         "drain": "node_drain", "task_exit": "task_crash", "hang": "hang", "stuck": "stuck",
         "checkpointed": "checkpointed", "requeued": "requeued", "grow": "grow"}
# Journal phase -> timeline key.
TIMELINE_KEYS = {"fault": "fault", "detected": "detected", "confirmed": "confirmed", "resubmitted": "resubmitted",
                 "running": "running", "first_step": "first_step_after_restore"}


def status_view(journal: Journal, uid: int, now: float) -> list[dict[str, Any]]:
    """Every job of ``uid``: state, incarnations with their layouts, progress, heartbeat lag and
    recoveries (the journal's view, plus the current incarnation). Each recovery says its ``path``
    (in_allocation, resubmitted, requeued, planned_migration), the Slurm job id before and after,
    the nodes removed and added per het component, and the spares left in the allocation (what the
    step supervisor reported; null for a resubmission, which takes spares from the cluster)."""
    out = []
    for job in journal.status(uid, now):
        incs = job["incarnations"]
        current = next((i for i in reversed(incs) if i["slurm_job_id"]), None)
        job["current_incarnation"] = current["number"] if current else None
        job["slurm_job_id"] = current["slurm_job_id"] if current else None
        job["data_parallel_size"] = (current["layout"] or {}).get("data_parallel_size") if current else None
        slurm_ids = {i["number"]: i["slurm_job_id"] for i in incs}
        job["recoveries"] = [recovery_view(r, slurm_ids) for r in job["recoveries"]]
        job["failslow"] = failslow_view(journal.decisions(job["name"], FAILSLOW_VERDICT))
        job["stopped"] = stopped_view(journal.decisions(job["name"], "refused"))
        job["start_failure"] = start_failure_view(journal.decisions(job["name"], START_FAILURE_VERDICT))
        job["stages"] = stage_names(job.get("spec"))
        out.append(job)
    return out


def stage_names(spec: Any) -> list[str]:
    """The job's stages by their own names, in order, as registered (``RegistryRecord.stages``)."""
    stages = spec.get("stages") if isinstance(spec, dict) else None
    if not isinstance(stages, list):
        return []
    return [s["name"] for s in stages if isinstance(s, dict) and isinstance(s.get("name"), str)]


def stopped_view(refusals: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Why the manager stopped the job for good without restarting it (bad input,
    policy/bad_input.py): the newest refusal that carries its one line."""
    lines = [d for d in refusals if isinstance(d["payload"], dict) and d["payload"].get("line")]
    if not lines:
        return None
    last = lines[-1]
    return {"cause": last["cause"], "incarnation": last["incarnation"], "time": last["time"],
            "reason": str(last["payload"]["line"])}


START_FAILURE_VERDICT = "start_failure"   # manager/daemon.py journals each launch that failed before its first heartbeat


def start_failure_view(failures: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest launch that failed before its first heartbeat: its line, exit code and full log
    (formats/start_failure.py), and how many such failures the job had."""
    records = [d for d in failures if isinstance(d["payload"], dict)]
    if not records:
        return None
    last = records[-1]
    p = last["payload"]
    return {"incarnation": last["incarnation"], "time": last["time"], "slurm_job_id": p.get("job_id"),
            "launch": p.get("launch"), "exit_code": p.get("exit_code"), "line": p.get("line", ""),
            "log": p.get("log", ""), "count": len(records)}


def recovery_path(cause: str, path: str | None, new_incarnation: int | None, plan: Any) -> str:
    """The recorded path; a journal from before paths were recorded: a requeue when no plan was made."""
    if path:
        return path
    return "requeued" if plan is None and cause != "grow" and new_incarnation is not None else "resubmitted"


def recovery_view(rec: dict[str, Any], slurm_ids: dict[int, str | None]) -> dict[str, Any]:
    plan, detail = rec.pop("plan") or {}, rec.pop("detail") or {}
    path = recovery_path(rec["cause"], rec["path"], rec["new_incarnation"], plan or None)
    removed: dict[str, list[str]] = {str(k): list(v) for k, v in (detail.get("removed") or {}).items()}
    added: dict[str, list[str]] = {str(k): list(v) for k, v in (detail.get("added") or {}).items()}
    for c in plan.get("components") or ():
        if c.get("removed"):
            removed.setdefault(str(c["het_offset"]), list(c["removed"]))
        if c.get("added"):
            added.setdefault(str(c["het_offset"]), list(c["added"]))
    before = slurm_ids.get(rec["incarnation"])
    after = slurm_ids.get(rec["new_incarnation"]) if rec["new_incarnation"] is not None else None
    if after is None and path in ("in_allocation", "requeued") and rec["new_incarnation"] is not None:
        after = before   # the same Slurm job runs the next life
    spares = detail.get("spares_left")
    return {**rec, "path": path, "slurm_job_id_before": before, "slurm_job_id_after": after,
            "nodes_removed": removed, "nodes_added": added,
            "spares_left": {str(k): int(v) for k, v in spares.items()} if isinstance(spares, dict) else None,
            "action": plan.get("action")}
FAILSLOW_VERDICT = "failslow"   # manager/failslow.py journals its decisions under this verdict
_FAILSLOW_ACTIONS = ("replace", "shrink", "keep")


def failslow_view(decisions: list[dict[str, Any]]) -> dict[str, Any]:
    """What the fail-slow watch decided: nodes flagged now, the last migration decision (with its
    estimate) and its outcome, the whole-job state."""
    flagged: dict[str, dict[str, Any]] = {}
    job_slow: dict[str, Any] | None = None
    migration: dict[str, Any] | None = None
    outcome: dict[str, Any] | None = None
    incarnation = max((d["incarnation"] for d in decisions if d["incarnation"] is not None), default=None)
    for d in decisions:
        p = d["payload"] or {}
        now_inc = d["incarnation"] == incarnation
        if d["cause"] == "flagged" and now_inc:
            flagged[p.get("node", "")] = {"time": d["time"], **p}
        elif d["cause"] == "cleared":
            flagged.pop(p.get("node", ""), None)
        elif d["cause"] == "job_slow" and now_inc:
            job_slow = {"time": d["time"], **p}
        elif d["cause"] == "job_ok":
            job_slow = None
        elif d["cause"] in _FAILSLOW_ACTIONS:
            migration = {"time": d["time"], "action": d["cause"], "incarnation": d["incarnation"], **p}
        elif d["cause"] == "outcome":
            outcome = {"time": d["time"], **p}
    return {"flagged": list(flagged.values()), "job_slow": job_slow, "migration": migration, "outcome": outcome}


def timeline_entries(journal: Journal, uid: int) -> list[dict[str, Any]]:
    """One entry per recovery, in the shape of ``slurm_omni.report.timeline``."""
    entries = []
    for job in journal.jobs(uid, states=JOB_STATES):
        slurm_ids = {i["number"]: i["slurm_job_id"] for i in journal.incarnations(job["name"])}
        for rec in journal.recoveries(job["name"]):
            if rec.times["confirmed"] is None:
                continue
            times = _monotone([rec.times[p] for p in PHASES])
            path = recovery_path(rec.cause, rec.path, rec.new_incarnation, rec.plan)
            entry: dict[str, Any] = {"job_id": str(slurm_ids.get(rec.incarnation) or job["name"]),
                                     "incarnation": rec.incarnation,
                                     **{TIMELINE_KEYS[p]: t for p, t in zip(PHASES, times, strict=True)},
                                     "kind": KINDS.get(rec.cause, rec.cause), "path": path}
            if rec.new_incarnation is not None:
                after = slurm_ids.get(rec.new_incarnation) or (
                    slurm_ids.get(rec.incarnation) if path in ("in_allocation", "requeued") else None)
                if after:
                    entry["new_job_id"] = str(after)
            if rec.plan is not None:
                entry["action"] = str(rec.plan.get("action", ""))
            elif rec.cause != "grow" and rec.new_incarnation is not None:
                entry["action"] = "requeue"
            entries.append(entry)
    return entries


def _monotone(times: list[float | None]) -> list[float | None]:
    """Phase times as the timeline requires them (never decreasing): a phase seen late (the poll
    that saw RUNNING came after the first heartbeat) is bounded by the next phase seen."""
    out = list(times)
    later: float | None = None
    for i in range(len(out) - 1, -1, -1):
        t = out[i]
        if t is not None:
            if later is not None and t > later:
                out[i] = later
            later = out[i]
    return out


def write_timeline(journal: Journal, uid: int, path: Path) -> None:
    write_atomic(path, json.dumps({"recoveries": timeline_entries(journal, uid)}, indent=1, sort_keys=True) + "\n",
                 durable=False)


def format_status(jobs: list[dict[str, Any]]) -> str:
    """The human view: one block per job, one line per recovery."""
    if not jobs:
        return "no registered jobs\n"
    lines = []
    for job in jobs:
        lag = job["heartbeat_lag_s"]
        stages = job.get("stages") or []
        names = _component_names(job, stages)
        lines.append(f"{job['name']}  {job['state']}  "
                     + (f"{' | '.join(stages)} stage{'s' if len(stages) > 1 else ''}  " if stages else "")
                     + f"incarnation {job['current_incarnation']} "
                     f"(Slurm job {job['slurm_job_id']}, dp {job['data_parallel_size']})  "
                     f"step {_n(job['global_step'])}  checkpoint {_n(job['last_checkpoint_step'])}  "
                     f"heartbeat lag {'-' if lag is None else f'{lag:.1f}s'}")
        stopped = job.get("stopped")
        if stopped:
            lines.append(f"  stopped ({stopped['cause']}): {stopped['reason']}")
        failed = job.get("start_failure")
        if failed:
            lines.append(f"  failed before its first heartbeat (incarnation {failed['incarnation']}, Slurm job "
                         f"{failed['slurm_job_id']}, exit {failed['exit_code']}): {failed['line'] or '-'} "
                         f"(full log: {failed['log'] or '-'})")
        for inc in job["incarnations"]:
            nodes = (inc["layout"] or {}).get("nodes") or {}
            where = " | ".join(f"{names.get(k, k)}: {','.join(v)}" for k, v in sorted(nodes.items())) or "-"
            lines.append(f"  incarnation {inc['number']}: Slurm job {_n(inc['slurm_job_id'])}  nodes {where}  "
                         f"{inc['end_reason'] or ''}".rstrip())
        lines.extend(_failslow_lines(job.get("failslow") or {}))
        for rec in job["recoveries"]:
            d = rec["durations"]
            steps = "  ".join(f"{p} +{d[p]:.1f}s" for p in PHASES[1:] if d.get(p) is not None)
            total = "-" if d["total"] is None else f"{d['total']:.1f}s"
            lines.append(f"  recovery of incarnation {rec['incarnation']} ({rec['cause']} on "
                         f"{','.join(rec['nodes']) or '-'}): {steps}  total {total}"
                         f"{'' if rec['complete'] else '  (in progress)'}")
            moved = "; ".join(f"{names.get(k, k)}: -{','.join(rec['nodes_removed'].get(k, [])) or '0'} "
                              f"+{','.join(rec['nodes_added'].get(k, [])) or '0'}"
                              for k in sorted({*rec["nodes_removed"], *rec["nodes_added"]}))
            spares = ("" if rec["spares_left"] is None else "  spares left "
                      + ", ".join(f"{k}: {v}" for k, v in sorted(rec["spares_left"].items())))
            lines.append(f"    path {rec['path']}: Slurm job {_n(rec['slurm_job_id_before'])} -> "
                         f"{_n(rec['slurm_job_id_after'])}  nodes {moved or '-'}{spares}")
    return "\n".join(lines) + "\n"


def _failslow_lines(fs: dict[str, Any]) -> list[str]:
    lines = [f"  fail-slow WARNING: {f.get('node')} (stage {f.get('stage')}) runs {f.get('ratio', 0):.2f}x its "
             f"peers ({f.get('kind')})" for f in fs.get("flagged") or ()]
    if fs.get("job_slow"):
        j = fs["job_slow"]
        lines.append(f"  fail-slow: whole job {j.get('ratio', 0):.2f}x slower than its best window ({j.get('cause')}); "
                     "no node stands out")
    mig = fs.get("migration")
    if mig:
        est = mig.get("estimate") or {}
        guess = (f"  estimate {est['step_now_s']:.3f} -> {est['step_replace_s']:.3f}s/step"
                 if est.get("step_now_s") is not None and est.get("step_replace_s") is not None else "")
        lines.append(f"  fail-slow decision ({mig['action']} {mig.get('node')}, incarnation {mig.get('incarnation')}): "
                     f"{'; '.join(mig.get('reasons') or ())}{guess}")
    out = fs.get("outcome")
    if out and out.get("step_measured_s") is not None:
        lines.append(f"  fail-slow outcome: {out['step_measured_s']:.3f}s/step after the migration "
                     f"(estimated {out.get('step_estimated_s') or 0:.3f}, before {out.get('step_before_s') or 0:.3f})")
    return lines


def _component_names(job: dict[str, Any], stages: list[str]) -> dict[str, str]:
    """Component key -> its stage's own name, when component N runs stage N (a heterogeneous job, or
    one stage); none when one allocation holds every stage (in-allocation: the key stays a number)."""
    counts = {len((inc["layout"] or {}).get("nodes") or {}) for inc in job["incarnations"]}
    if len(stages) == 1 or counts == {len(stages)}:
        return {str(i): name for i, name in enumerate(stages)}
    return {}


def _n(value: object) -> str:
    return "-" if value is None else str(value)
