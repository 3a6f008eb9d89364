"""``formats.decode``: the writer's own bytes skip the slower duplicate-key check, anything else still
passes it (issue 19: the supervisor decodes about 1,500 heartbeat lines per poll at 2,048 ranks)."""

from __future__ import annotations

import pytest

from slurm_omni import formats
from slurm_omni.formats import RecordRejected, decode, encode
from slurm_omni.formats.heartbeat import HeartbeatRecord

BEAT = HeartbeatRecord(rank=3, stage=0, dp_rank=3, pid=9, incarnation=1, job_id="42", step=7, phase="training",
                       time=1764460000.25, node="node2", metrics={"loss": 2.5})


class _Refuses:
    def decode(self, _text: str) -> None:
        raise AssertionError("the duplicate-key check ran")


@pytest.mark.parametrize("data", [encode(BEAT), encode(BEAT).rstrip(b"\n"), encode(BEAT).decode()])
def test_the_writers_own_bytes_decode_without_the_duplicate_check(monkeypatch: pytest.MonkeyPatch,
                                                                   data: bytes | str) -> None:
    monkeypatch.setattr(formats, "_DUPLICATES", _Refuses())
    assert decode(data, HeartbeatRecord, "rank-3.json") == BEAT


@pytest.mark.parametrize("data", [
    encode(BEAT).replace(b'"rank":3', b'"rank": 3'),                      # another writer's spacing
    encode(BEAT).replace(b'"metrics":{', b'"metrics":{"loss":1.0,'),       # a duplicate inside
    encode(BEAT).replace(b'"step":7', b'"step":7,"step":8'),               # and at the top
])
def test_other_bytes_still_pass_the_duplicate_check(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr(formats, "_DUPLICATES", _Refuses())
    with pytest.raises(AssertionError, match="the duplicate-key check ran"):
        decode(data, HeartbeatRecord, "rank-3.json")


def test_a_duplicate_key_is_still_refused() -> None:
    for data in (encode(BEAT).replace(b'"step":7', b'"step":7,"step":8'),
                 encode(BEAT).replace(b'"metrics":{', b'"metrics":{"loss":1.0,')):
        with pytest.raises(RecordRejected, match="duplicate key"):
            decode(data, HeartbeatRecord, "rank-3.json")
