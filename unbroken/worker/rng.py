"""The process's random-number state as training state: captured and restored exactly.

torch (CPU, and CUDA when initialized), Python's ``random`` and, when the script imported
it, numpy. The captured form holds tensors and plain values only, so the checkpoint codec
and the replica transfer carry it without pickle.
"""

from __future__ import annotations

import array
import random
import sys
from typing import Any

import torch


def capture() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    # Python's 625-word state as one tensor: the codec stores it as bytes, not 625 JSON numbers.
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": [version, torch.frombuffer(array.array("q", internal), dtype=torch.int64), gauss]}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    words = internal.tolist() if isinstance(internal, torch.Tensor) else internal  # older checkpoints: a list
    random.setstate((version, tuple(words), gauss))
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, gauss_value = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss_value))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
