"""``bench`` is a folder of the repository, not an installed package: make it importable when
pytest runs as ``.venv/bin/pytest`` (``python -m pytest`` already has the repository on the path)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
if REPO not in sys.path:
    sys.path.insert(0, REPO)
