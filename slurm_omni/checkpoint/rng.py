"""The process-wide random streams as JSON: python's ``random``, numpy's legacy global generator, torch's
CPU generator and every CUDA device's generator where CUDA is initialised.

Generators that the runtime owns (a ``numpy.random.Generator`` per data source, a ``torch.Generator``
for dropout masks) belong in its own state; ``generator_state``/``set_generator_state`` turn a
torch.Generator into JSON too.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, list(mt), gauss],
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore(state: dict[str, Any]) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [_unb64(s) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def generator_state(gen: torch.Generator) -> str:
    return _b64(gen.get_state())


def set_generator_state(gen: torch.Generator, state: str) -> None:
    gen.set_state(_unb64(state))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
