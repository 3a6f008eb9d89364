"""Which Slurm versions the embedded cluster runs, where their Debian roots come from (pure).

22.05 is the host's own packages (Debian 12). 24.11 (Debian 13, trixie) and 26.05 (Debian sid) run
from a Debian root made once with ``debootstrap --variant=minbase`` and cached outside the state
directory, so every state directory of that version shares it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from slurm_omni.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SlurmVersion:
    version: str              # "24.11"
    suite: str | None         # the Debian suite that carries it; None: the host's own packages


HOST_VERSION = "22.05"
VERSIONS: dict[str, SlurmVersion] = {
    "22.05": SlurmVersion("22.05", None),
    "24.11": SlurmVersion("24.11", "trixie"),
    "26.05": SlurmVersion("26.05", "sid"),
}

ROOT_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "libslurm-dev")
"""Slurm and munge inside the root; libslurm-dev carries the headers the SPANK plugin is built with."""

PYTHON_RUNTIME_PACKAGES = (
    "libexpat1", "zlib1g", "libssl3t64", "libffi8", "libsqlite3-0", "libbz2-1.0", "liblzma5", "libuuid1",
    "libncursesw6", "libreadline8t64", "libnsl2", "libtirpc3t64", "libdb5.3t64", "libcrypt1",
)
"""The libraries the host's Python 3.11 and its extension modules link (``ldd`` of python3.11 and of
lib-dynload on Debian 12), by their trixie/sid names: jobs run that Python, bind-mounted, in the root."""


def slurm_version(text: str) -> SlurmVersion:
    try:
        return VERSIONS[text]
    except KeyError:
        raise ConfigError(f"cluster: bad slurm_version = {text!r} (allowed: {', '.join(VERSIONS)})") from None


_ONE_LINE = re.compile(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)")


def debian_mirror(sources: list[tuple[str, str]]) -> str | None:
    """The first Debian archive URI in apt's sources (``(file name, text)`` pairs, in apt's order):
    one-line ``deb URI SUITE ...`` entries and deb822 stanzas alike; security and update suites and
    other archives (anything whose suites are not Debian's) are skipped."""
    for name, text in sources:
        if name.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                fields = _deb822(stanza)
                if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes") == "no":
                    continue
                for uri in fields.get("uris", "").split():
                    if any(_debian_suite(s) for s in fields.get("suites", "").split()):
                        return uri.rstrip("/")
        else:
            for line in text.splitlines():
                m = _ONE_LINE.match(line)
                if m and _debian_suite(m.group(2)):
                    return m.group(1).rstrip("/")
    return None


def _deb822(stanza: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    key = None
    for line in stanza.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if line[0].isspace() and key:
            fields[key] += " " + line.strip()
            continue
        key, _, value = line.partition(":")
        key = key.strip().lower()
        fields[key] = value.strip()
    return fields


_DEBIAN_SUITES = {"bookworm", "trixie", "forky", "sid", "stable", "testing", "unstable", "bullseye"}


def _debian_suite(suite: str) -> bool:
    return suite in _DEBIAN_SUITES


def read_apt_sources(etc_apt: Path = Path("/etc/apt")) -> list[tuple[str, str]]:
    files = [etc_apt / "sources.list"]
    files += sorted(p for p in (etc_apt / "sources.list.d").glob("*") if p.suffix in (".list", ".sources"))
    out = []
    for path in files:
        try:
            out.append((path.name, path.read_text()))
        except OSError:
            continue
    return out


def roots_dir(environ: dict[str, str] | None = None, *, is_root: bool | None = None) -> Path:
    """Where the Debian roots are cached: ``OMNI_SLURM_ROOTS``, else /var/cache/slurm-omni/roots for
    root, else ``$XDG_CACHE_HOME/slurm-omni/roots`` (``~/.cache`` by default)."""
    env = os.environ if environ is None else environ
    if env.get("OMNI_SLURM_ROOTS"):
        return Path(env["OMNI_SLURM_ROOTS"])
    if os.geteuid() == 0 if is_root is None else is_root:
        return Path("/var/cache/slurm-omni/roots")
    cache = Path(env.get("XDG_CACHE_HOME") or Path(env.get("HOME", "~")).expanduser() / ".cache")
    return cache / "slurm-omni" / "roots"
