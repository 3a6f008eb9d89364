"""Quoting for the two languages a rendered batch script speaks.

The body of the script is bash: values pass ``shlex.quote``. The ``#SBATCH`` lines are read by
sbatch's own tokenizer (Slurm 22.05 ``src/sbatch/opt.c:_get_argument``): whitespace splits words,
``'`` and ``"`` quote, a backslash escapes the next character and an unquoted ``#`` starts a
comment. It cannot carry a newline, and it blanks the word ``packjob`` anywhere in a line, so such
values are refused rather than mangled.
"""

from __future__ import annotations

import re
import shlex

from slurm_omni.errors import ConfigError

_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
_SBATCH_FORBIDDEN_WORDS = ("packjob", "hetjob")


class Quoted(str):
    """A string that has passed a quoting filter; the template engine renders nothing else."""

    __slots__ = ()


def shell(value: object) -> Quoted:
    """One bash word that expands to exactly ``str(value)``."""
    text = _text(value, "shell")
    return Quoted(shlex.quote(text))


def sbatch(value: object) -> Quoted:
    """One ``#SBATCH`` argument word that sbatch reads back as exactly ``str(value)``."""
    text = _text(value, "#SBATCH")
    if "\n" in text or "\r" in text:
        raise ConfigError(f"render: couldn't put {text!r} on an #SBATCH line: it holds a newline "
                          f"(sbatch reads directives line by line)")
    lowered = text.lower()
    for word in _SBATCH_FORBIDDEN_WORDS:
        if word in lowered:
            raise ConfigError(f"render: couldn't put {text!r} on an #SBATCH line: it holds {word!r} "
                              f"(sbatch treats it as a component separator)")
    if _SBATCH_PLAIN.fullmatch(text):
        return Quoted(text)
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return Quoted(f'"{escaped}"')


def slurm_filename(path: object) -> str:
    """A path for ``--output``/``--error`` whose ``%`` stays literal: Slurm filename patterns
    expand ``%j``, ``%x``... and read ``%%`` as one percent sign. A backslash would switch pattern
    expansion off for the whole name, so it is refused."""
    text = _text(path, "filename")
    if "\\" in text:
        raise ConfigError(f"render: couldn't use {text!r} in an output file name: it holds a "
                          f"backslash (Slurm then stops expanding %j)")
    return text.replace("%", "%%")


def _text(value: object, where: str) -> str:
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"render: couldn't quote {value!r} for {where}: not a string or number")
    text = str(value)
    if "\0" in text:
        raise ConfigError(f"render: couldn't quote {text!r} for {where}: it holds a NUL byte")
    return text
