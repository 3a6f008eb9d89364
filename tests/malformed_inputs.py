"""Hypothesis strategies of malformed inputs, shared by the reader and manager property tests."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
           | st.text(max_size=20) | st.sampled_from(["", "٣", "n[٣]", "²", "node[0-999999,0-999999,0-999999]",
                                                     "NaN", "-1", "1e999", "\u0000", "a\nb"]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
DEEP = st.integers(900, 3500).map(lambda n: "[" * n + "]" * n)
"""Nesting past Python's recursion limit (RecursionError in json and msgspec)."""


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=True)


def mutated(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """``valid`` with one key's value replaced (by any JSON, a deep nest), one key dropped or one added."""
    keys = sorted(valid)
    replaced = st.tuples(st.sampled_from(keys), JSON.map(_dumps) | DEEP).map(
        lambda kv: "{" + ", ".join(f"{json.dumps(k)}: {kv[1] if k == kv[0] else _dumps(v)}"
                                   for k, v in valid.items()) + "}")
    dropped = st.sampled_from(keys).map(lambda k: _dumps({x: v for x, v in valid.items() if x != k}))
    added = st.tuples(st.text(min_size=1, max_size=8), JSON).map(
        lambda kv: _dumps({**valid, kv[0]: kv[1]}) if kv[0] not in valid else _dumps(valid) + "x")
    return st.one_of(replaced, dropped, added).map(str.encode)


def garbage(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """Any bytes, any JSON, a deep nest, or a near miss of ``valid``."""
    return st.one_of(st.binary(max_size=300), JSON.map(lambda v: _dumps(v).encode()),
                     DEEP.map(str.encode), mutated(valid))
