"""The sinfo/squeue --json parsers and the hostlist code under generated input: a parse or one
SlurmError, never another exception; hostlists are bounded before any name is made."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from malformed_inputs import DEEP, JSON

from slurm_omni.errors import SlurmError
from slurm_omni.slurm.hostlist import MAX_HOSTS, compress, expand
from slurm_omni.slurm.parse_json import parse_sinfo_json, parse_squeue_json

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# every version's recorded outputs (h12's parsers read 22.05, 24.11 and 26.05 shapes)
SINFO = [json.loads(p.read_text()) for p in sorted(FIXTURES.glob("slurm-*/sinfo_down_drain.json"))
         + sorted(FIXTURES.glob("slurm-*/scontrol_nodes_down_drain.json"))]
SQUEUE = [json.loads(p.read_text()) for p in sorted(FIXTURES.glob("slurm-*/squeue_het_array.json"))]


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            out += _paths(v, (*prefix, i))
    return out


def _replace(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[path[0]] = _replace(doc[path[0]], path[1:], value)   # type: ignore[index]
    return copy


def recorded_with_one_change(docs: list[dict[str, Any]]) -> st.SearchStrategy[str]:
    """A recorded real output with one value anywhere replaced by any JSON (a list for
    ``job_state`` as Slurm 23.02+ sends it, a number for a name, an object for a number...)."""
    def one(doc: dict[str, Any]) -> st.SearchStrategy[str]:
        return st.tuples(st.sampled_from(_paths(doc)), JSON | st.just(["RUNNING"])
                         | st.just({"set": True, "infinite": False, "number": 3})).map(
            lambda pv: json.dumps(_replace(doc, pv[0], pv[1]), allow_nan=True))
    return st.one_of([one(doc) for doc in docs])


def _parses_or_slurm_error(parse: Any, text: str) -> None:
    try:
        parse(text)
    except SlurmError as e:
        assert str(e).split(":")[0] in ("sinfo", "squeue", "hostlist")


@given(recorded_with_one_change(SINFO) | JSON.map(json.dumps) | DEEP | st.text(max_size=200))
def test_sinfo_parser(text: str) -> None:
    assert len(SINFO) >= 3
    _parses_or_slurm_error(parse_sinfo_json, text)


@given(recorded_with_one_change(SQUEUE) | JSON.map(json.dumps) | DEEP | st.text(max_size=200))
def test_squeue_parser(text: str) -> None:
    _parses_or_slurm_error(parse_squeue_json, text)


NAMES = st.from_regex(r"[a-z]{1,4}(-[a-z]{1,3})?[0-9]{0,4}", fullmatch=True)


@given(st.lists(NAMES, max_size=60))
def test_compress_then_expand_gives_the_same_names(names: list[str]) -> None:
    back = expand(compress(names))
    assert sorted(back) == sorted(set(names)) and len(back) == len(set(names))


@given(st.text(alphabet="n0123456789[]-,٣²x ", max_size=40))
def test_expand_is_bounded_and_ascii(expr: str) -> None:
    try:
        names = expand(expr, limit=1000)
    except SlurmError as e:
        assert str(e).startswith("hostlist: couldn't")
    else:
        assert len(names) <= 1000
        assert not any(c in n for n in names for c in "[],")


@pytest.mark.parametrize("expr", ["node[0-999999,0-999999,0-999999]", "n[0-999999999999999999]",
                                  "a[0-600000],b[0-600000]"])
def test_a_hostlist_past_the_bound_is_refused_before_anything_is_allocated(expr: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(SlurmError, match=f"limit {MAX_HOSTS}"):
            expand(expr)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("expr", ["n[٣]", "n[1-٣]", "n[²]", "n[1-" + "9" * 30 + "]"])
def test_only_ascii_digits_make_a_range(expr: str) -> None:
    with pytest.raises(SlurmError, match="ASCII digits"):
        expand(expr)
