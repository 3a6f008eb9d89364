"""The manifest's JSON decoder (``format._decode``): msgspec's where it takes the bytes, json's where it
refuses them, so that a manifest reads exactly as ``json.loads`` reads it."""

from __future__ import annotations

import json
import math

import pytest

from slurm_omni.checkpoint import format as fmt


@pytest.mark.parametrize("text", [
    b'{"step": 1, "state": {"loss": NaN, "best": [Infinity, -Infinity]}}',   # a runtime's state (allow_nan)
    b'\xef\xbb\xbf{"a": 1}',                                                # a byte-order mark
    b'{"a": 1e400}',                                                        # out of a float's range
    b'{"a": 123456789012345678901234567890, "b": [1.5, -0.0, "\\u00e9", true, null]}',
    b'{"a": 1, "a": 2}',                                                    # the last key wins, as in json
    b'["\\ud800"]',                                                         # a lone surrogate
])
def test_a_manifest_decodes_as_json_loads_reads_it(text: bytes) -> None:
    got, want = fmt._decode(text), json.loads(text)
    assert repr(got) == repr(want)
    if isinstance(want, dict) and "state" in want:
        assert math.isnan(got["state"]["loss"])


@pytest.mark.parametrize("text", [b'{"a": 1,}', b"[1] x", b'"a\x01b"', b"01", b"[.5]", b""])
def test_what_json_refuses_is_refused(text: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        fmt._decode(text)
