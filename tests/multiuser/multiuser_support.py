"""The unprivileged users of the multiuser tests (scripts/setup.sh creates them)."""

from __future__ import annotations

import os
import pwd
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: Path

    def run(self, *argv: str, env: dict[str, str] | None = None, timeout: float = 60,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """``argv`` as this user (setpriv keeps the environment given; HOME is theirs)."""
        full = {**(env if env is not None else os.environ), "HOME": str(self.home), "USER": self.name,
                "LOGNAME": self.name}
        return subprocess.run(["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", *argv],
                              env=full, capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False)

    def own(self, path: Path) -> Path:
        """Hand ``path`` (and everything below it) to this user."""
        for root, dirs, files in os.walk(path):
            for name in (*dirs, *files):
                os.lchown(os.path.join(root, name), self.uid, self.gid)
        os.lchown(path, self.uid, self.gid)
        return path


def lookup(name: str) -> User:
    """The site user ``name`` (KeyError when there is none)."""
    pw = pwd.getpwnam(name)
    return User(name, pw.pw_uid, pw.pw_gid, Path(pw.pw_dir))
