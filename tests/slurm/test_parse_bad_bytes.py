"""Slurm output carrying bytes that are not UTF-8, as users can put them there (issue 18, finding 4).

``squeue_bad_bytes.json`` and ``sinfo_bad_bytes_job_queued.json`` (tests/fixtures/slurm-22.05/) were
recorded on the embedded cluster with three jobs: bob's ``sbatch --job-name=$'bob\\xff\\xfe'``
(cancelled, 3001), alice's ``omni-alice-train`` running on node1 (3002), and bob's held
``--job-name=$'bob\\xff\\xfe' --comment=$'c\\xc3(' --output=$'/tmp/bob\\xff.out'`` (3003). squeue prints
those bytes as they are; sinfo lists no job field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_omni.slurm.parse_json import read_sinfo_json, read_squeue_json
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.slurm.types import JobState

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm-22.05"
RAW = (FIXTURES / "squeue_bad_bytes.json").read_bytes()


def test_the_recording_holds_bytes_that_are_not_utf8() -> None:
    assert b'"name": "bob\xff\xfe"' in RAW and b'"comment": "c\xc3("' in RAW
    with pytest.raises(UnicodeDecodeError):
        RAW.decode()


def test_the_runner_decodes_with_replacement_and_keeps_utf8_exact() -> None:
    out = CommandRunner(retries=0).run(["printf", "bob\\377\\376 omni-\\316\\251"]).stdout
    assert out == "bob\ufffd\ufffd omni-\u03a9"


def test_every_job_is_read_ours_exactly() -> None:
    read = read_squeue_json(RAW.decode("utf-8", errors="replace"))
    assert read.skipped == []
    jobs = {j.job_id: j for j in read.jobs}
    assert sorted(jobs) == [3001, 3002, 3003]
    alice = jobs[3002]
    assert (alice.name, alice.user, alice.state, alice.components[0].nodes) == \
        ("omni-alice-train", "alice", JobState.RUNNING, ("node1",))
    assert (jobs[3003].name, jobs[3003].user, jobs[3003].state) == ("bob\ufffd\ufffd", "bob", JobState.PENDING)
    assert jobs[3003].comment == "c\ufffd("
    assert jobs[3001].state is JobState.CANCELLED


def test_one_unreadable_record_is_skipped_not_the_others() -> None:
    doc = json.loads(RAW.decode("utf-8", errors="replace"))
    (bobs,) = [r for r in doc["jobs"] if r["job_id"] == 3003]
    bobs["job_state"] = {"current": "PENDING"}             # a shape no Slurm version has
    bobs["nodes"] = 17
    read = read_squeue_json(json.dumps(doc))
    assert sorted(j.job_id for j in read.jobs) == [3001, 3002]
    (skipped,) = read.skipped
    assert skipped.job_ids == frozenset({3003})
    line = skipped.line("squeue")
    assert line.startswith("squeue: skipped job 3003: couldn't read job 3003 job_state") and "\n" not in line


def test_a_het_job_with_one_unreadable_component_is_skipped_whole() -> None:
    base = {"job_state": "RUNNING", "name": "omni-x", "user_name": "alice", "nodes": "node1"}
    doc = {"jobs": [{**base, "job_id": 10, "het_job_id": 10, "het_job_offset": 0},
                    {**base, "job_id": 11, "het_job_id": 10, "het_job_offset": 1, "nodes": ["node2"]},
                    {**base, "job_id": 12}]}
    read = read_squeue_json(json.dumps(doc))
    assert [j.job_id for j in read.jobs] == [12]
    (skipped,) = read.skipped
    assert skipped.job_ids == frozenset({10, 11}) and skipped.what == "job 10"


def test_sinfo_beside_such_a_job_reads_every_node() -> None:
    text = (FIXTURES / "sinfo_bad_bytes_job_queued.json").read_bytes().decode("utf-8", errors="replace")
    read = read_sinfo_json(text)
    assert read.skipped == [] and sorted(n.name for n in read.nodes) == [f"node{i}" for i in range(1, 9)]
