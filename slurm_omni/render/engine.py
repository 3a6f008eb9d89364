"""The jinja2 environment for batch scripts: nothing reaches the output unquoted.

``finalize`` lets through only integers and :class:`~slurm_omni.config.quoting.Quoted` strings,
so a template that prints a raw value fails to render instead of producing an unsafe script.
Filters: ``sh`` (one bash word), ``argv`` (a list of bash words), ``sbatch`` (one ``#SBATCH`` word), ``comment`` (JSON-escaped, for ``#`` lines), ``literal`` (a template's own constant, checked to be plain).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import jinja2

from slurm_omni.config import quoting
from slurm_omni.errors import ConfigError

TEMPLATE_ENV = "OMNI_TEMPLATE_DIR"
_LITERAL = re.compile(r"[A-Za-z0-9_@%+=:,./-]*")


def template_dir() -> Path:
    """``$OMNI_TEMPLATE_DIR``, else ``sbatch_templates/`` of the source tree (editable install), else
    the copy a wheel installs under ``<prefix>/share/slurm-omni/sbatch_templates``."""
    env = os.environ.get(TEMPLATE_ENV)
    if env:
        return Path(env)
    source = Path(__file__).resolve().parents[2] / "sbatch_templates"
    if source.is_dir():
        return source
    return Path(sys.prefix) / "share" / "slurm-omni" / "sbatch_templates"


def _finalize(value: Any) -> Any:
    if isinstance(value, quoting.Quoted) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ConfigError(f"render: couldn't print {value!r}: template value is not quoted "
                      f"(pass it through |sh, |sbatch or |literal)")


def _literal(value: object) -> quoting.Quoted:
    text = str(value)
    if not _LITERAL.fullmatch(text):
        raise ConfigError(f"render: couldn't print {text!r} as a literal: it needs quoting (use |sh)")
    return quoting.Quoted(text)


def _argv(values: object) -> quoting.Quoted:
    """Several bash words, each quoted, separated by spaces."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ConfigError(f"render: couldn't print {values!r} as words: not a list")
    return quoting.Quoted(" ".join(quoting.shell(v) for v in values))


def _comment(value: object) -> quoting.Quoted:
    """A value inside a ``#`` comment line: JSON-escaped, so a newline cannot end the comment."""
    return quoting.Quoted(json.dumps(str(value), ensure_ascii=True))


def make_environment(directory: Path | None = None) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(directory or template_dir())),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=_finalize,
        # bash says ${#array[@]}: jinja's default "{#" comment marker would swallow it.
        comment_start_string="{##",
        comment_end_string="##}",
    )
    env.filters["sh"] = quoting.shell
    env.filters["sbatch"] = quoting.sbatch
    env.filters["literal"] = _literal
    env.filters["comment"] = _comment
    env.filters["argv"] = _argv
    return env


def render(name: str, context: dict[str, Any], directory: Path | None = None) -> str:
    try:
        template = make_environment(directory).get_template(name)
    except jinja2.TemplateNotFound as e:
        raise ConfigError(f"render: couldn't find template {name!r} in {directory or template_dir()} "
                          f"(set {TEMPLATE_ENV})") from e
    try:
        return template.render(**context)
    except jinja2.UndefinedError as e:
        raise ConfigError(f"render: couldn't render {name}: {e.message}") from e
