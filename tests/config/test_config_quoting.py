"""The quoting filters: shell words and #SBATCH words read back unchanged, or are refused."""

from __future__ import annotations

import subprocess

import pytest

from slurm_omni.config import quoting
from slurm_omni.errors import ConfigError

HOSTILE = [
    "plain", "with space", "it's", 'say "hi"', "$(reboot)", "`id`", "new\nline", "back\\slash", "semi;colon",
    "glob*?[x]", "%j and %%", "#hash", "tab\there", "", "-dash", "ünïcode",
]


def sbatch_read(line: str) -> list[str]:
    """Slurm 22.05's tokenizer of an #SBATCH line (src/sbatch/opt.c:_get_argument), word by word."""
    words, i = [], 0
    while i < len(line):
        while i < len(line) and line[i].isspace():
            i += 1
        if i >= len(line):
            break
        word, quote, escaped = [], "", False
        while i < len(line) and (quote or not line[i].isspace()) and line[i] != "\n":
            c = line[i]
            if escaped:
                escaped = False
            elif c == "\\":
                escaped, i = True, i + 1
                continue
            elif quote:
                if c == quote:
                    quote, i = "", i + 1
                    continue
            elif c in "\"'":
                quote, i = c, i + 1
                continue
            elif c == "#":
                return words + (["".join(word)] if word else [])
            word.append(c)
            i += 1
        if quote:
            raise ValueError("unmatched quote")
        words.append("".join(word))
    return words


@pytest.mark.parametrize("value", HOSTILE)
def test_shell_word_round_trip(value: str) -> None:
    out = subprocess.run(["bash", "-c", f"printf %s {quoting.shell(value)}"], capture_output=True, text=True,
                         check=True, timeout=10).stdout
    assert out == value


@pytest.mark.parametrize("value", [v for v in HOSTILE if "\n" not in v and v])
def test_sbatch_word_round_trip(value: str) -> None:
    assert sbatch_read(f"--output={quoting.sbatch(value)}") == [f"--output={value}"]


@pytest.mark.parametrize(("value", "message"), [
    ("new\nline", "holds a newline"),
    ("my-hetjob-x", "holds 'hetjob'"),
    ("PackJob", "holds 'packjob'"),
    ("nul\0byte", "NUL byte"),
])
def test_sbatch_word_refused(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        quoting.sbatch(value)


def test_slurm_filename_keeps_percent_literal() -> None:
    assert quoting.slurm_filename("/logs/100%/") == "/logs/100%%/"
    with pytest.raises(ConfigError, match="backslash"):
        quoting.slurm_filename("/logs\\x")


@pytest.mark.parametrize("value", [None, True])
def test_non_values_refused(value: object) -> None:
    with pytest.raises(ConfigError, match="not a string or number"):
        quoting.shell(value)
