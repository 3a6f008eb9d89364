"""``python -m bench.goodput``: see bench/goodput/run.py."""

from __future__ import annotations

import sys

from bench.goodput.run import main

sys.exit(main())
