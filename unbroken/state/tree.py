"""Split a nested training state into flat tensors plus a JSON spec, and back.

`flatten_state` turns a tree (model and optimizer state dicts, RNG states, loop counters)
into `{name: cpu contiguous tensor}` for safetensors plus a JSON-serializable spec that
records everything else exactly; `unflatten_state` is its inverse. Nothing here pickles.

Spec nodes: JSON null/bool/int/str and finite floats stand for themselves; every JSON
object is a tagged node `{"t": ...}` (dict, list, tuple, tensor, ...). Dict keys (str or
int) are stored in `[key, node]` pairs, so JSON keeps an int key an int and order is kept.
Pure functions; no module state.
"""

from __future__ import annotations

import base64
import math
import sys
from collections import OrderedDict
from typing import Any

import torch

from unbroken.errors import CheckpointCorrupt, CheckpointError
from unbroken.state.dtypes import SAFETENSORS_NAMES, dtype_name, dtype_named
from unbroken.state.spec import ROOT_NAME, SPEC_FORMAT, SPEC_VERSION, is_plain_name

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def flatten_state(tree: Any) -> tuple[dict[str, torch.Tensor], dict]:
    """Return `(tensors, spec)` for `tree`.

    Tensor names are the "/"-joined path in the tree (e.g. "model/wte.weight"), made
    unique with a "#N" suffix on collision. Tensors are detached, moved to CPU and made
    contiguous; on CPU they may alias the caller's memory, so write them out before the
    training loop mutates them. Entries that are the same view of the same storage (tied
    weights) are stored once; other overlapping views are cloned, because safetensors
    refuses tensors that share memory. Raises CheckpointError for an unsupported leaf,
    naming its path and type.
    """
    flattener = _Flattener()
    root = flattener.node(tree, ())
    return flattener.tensors, {"format": SPEC_FORMAT, "version": SPEC_VERSION, "root": root}


def unflatten_state(tensors: dict[str, torch.Tensor], spec: dict) -> Any:
    """Rebuild the tree that `flatten_state` split into `(tensors, spec)`.

    Raises CheckpointCorrupt when the spec is not ours or names a missing tensor.
    """
    if not isinstance(spec, dict) or spec.get("format") != SPEC_FORMAT:
        raise CheckpointCorrupt(f"state spec is not an {SPEC_FORMAT!r} spec")
    if spec.get("version") != SPEC_VERSION:
        raise CheckpointCorrupt(
            f"state spec version {spec.get('version')!r} is not supported (expected {SPEC_VERSION})")
    return _Unflattener(tensors).node(spec.get("root"), ())


def _path_str(path: tuple) -> str:
    return "/".join(str(p) for p in path) or "<root>"


class _Flattener:
    """Owns the tensors collected during one `flatten_state` call and their dedup tables."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._view_names: dict[tuple, str] = {}  # identical view of a storage -> name
        self._cpu_storages: set[int] = set()  # data_ptrs of CPU storages already saved

    def node(self, x: Any, path: tuple) -> Any:
        kind = type(x)
        if x is None or kind in (bool, int, str):
            return x
        if kind is float:
            if math.isfinite(x):
                return x
            return {"t": "float", "v": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
        if kind in (dict, OrderedDict):
            return self._dict(x, path)
        if kind in (list, tuple):
            return {"t": kind.__name__, "items": [self.node(v, path + (i,)) for i, v in enumerate(x)]}
        if kind is torch.Size:
            return {"t": "size", "v": list(x)}
        if kind is bytes:
            return {"t": "bytes", "v": base64.b64encode(x).decode("ascii")}
        if isinstance(x, torch.Tensor):
            try:
                return self._tensor(x, path)
            except RuntimeError as exc:  # e.g. a tensor subclass without plain storage
                raise CheckpointError(f"cannot checkpoint the tensor at {_path_str(path)!r} "
                                      f"({kind.__qualname__}): {exc}") from exc
        np = sys.modules.get("numpy")  # a numpy object implies numpy is already imported
        if np is not None and isinstance(x, (np.ndarray, np.generic)):
            return self._numpy(np, x, path)
        raise CheckpointError(
            f"cannot checkpoint the value at {_path_str(path)!r}: type {kind.__module__}."
            f"{kind.__qualname__} is not supported (use tensors, numbers, str, bytes, None, "
            "and dict/list/tuple of those)")

    def _dict(self, x: dict, path: tuple) -> dict:
        items = []
        for key, value in x.items():
            if type(key) not in (str, int):
                raise CheckpointError(
                    f"cannot checkpoint the dict at {_path_str(path)!r}: key {key!r} has type "
                    f"{type(key).__qualname__}; only str and int keys are supported")
            items.append([key, self.node(value, path + (key,))])
        out: dict[str, Any] = {"t": "dict", "items": items}
        if type(x) is OrderedDict:
            out["ordered"] = True
            # nn.Module.state_dict() carries per-module versions in `_metadata`.
            metadata = getattr(x, "_metadata", None)
            if metadata is not None:
                out["metadata"] = self.node(metadata, path + ("_metadata",))
        return out

    def _tensor(self, x: torch.Tensor, path: tuple) -> dict:
        where = _path_str(path)
        if x.layout != torch.strided or x.is_quantized or x.device.type == "meta":
            raise CheckpointError(
                f"cannot checkpoint the tensor at {where!r}: layout {x.layout}, device "
                f"{x.device}, quantized={x.is_quantized}; only dense tensors with data are supported")
        view_key = None
        if x.untyped_storage().nbytes() > 0:
            view_key = (str(x.device), x.untyped_storage().data_ptr(), x.storage_offset(),
                        tuple(x.shape), x.stride(), x.dtype)
            if view_key in self._view_names:  # tied weights: store once, point twice
                return {"t": "tensor", "k": self._view_names[view_key]}
        t = x.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        if t.untyped_storage().nbytes() > 0:
            if t.untyped_storage().data_ptr() in self._cpu_storages:
                t = t.clone()  # a different view of a storage already saved
            self._cpu_storages.add(t.untyped_storage().data_ptr())
        out: dict[str, Any] = {"t": "tensor"}
        if t.dtype not in SAFETENSORS_NAMES:  # stored as raw bytes (uint8), its dtype named in the spec
            out["dtype"] = dtype_name(t.dtype)
            out["shape"] = list(t.shape)
            t = t.reshape(-1).view(torch.uint8)
        out["k"] = self._add(t, path)
        if view_key is not None:
            self._view_names[view_key] = out["k"]
        return out

    def _numpy(self, np: Any, x: Any, path: tuple) -> dict:
        if x.dtype.hasobject:
            raise CheckpointError(
                f"cannot checkpoint the numpy value at {_path_str(path)!r}: dtype {x.dtype} holds "
                "python objects")
        if isinstance(x, np.generic):
            raw = base64.b64encode(x.tobytes()).decode("ascii")
            return {"t": "np_scalar", "dtype": x.dtype.str, "v": raw}
        flat = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
        name = self._add(torch.from_numpy(flat.copy()), path)
        return {"t": "ndarray", "k": name, "dtype": x.dtype.str, "shape": list(x.shape)}

    def _add(self, t: torch.Tensor, path: tuple) -> str:
        base = "/".join(str(p) for p in path) or ROOT_NAME
        if not is_plain_name(base):  # e.g. a key ".." or "a\x00b": the spec maps a plain name
            base = f"{ROOT_NAME}#t{len(self.tensors)}"
        name, n = base, 1
        while name in self.tensors:
            n += 1
            name = f"{base}#{n}"
        self.tensors[name] = t
        return name


class _Unflattener:
    """Rebuilds one tree from its spec; owns nothing beyond the tensors it is given."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def node(self, node: Any, path: tuple) -> Any:
        if node is None or type(node) in (bool, int, float, str):
            return node
        if not isinstance(node, dict):
            raise self._bad(path, f"unexpected {type(node).__name__} node")
        tag = node.get("t")
        try:
            if tag == "dict":
                return self._dict(node, path)
            if tag in ("list", "tuple"):
                items = [self.node(v, path + (i,)) for i, v in enumerate(node["items"])]
                return items if tag == "list" else tuple(items)
            if tag == "float":
                return _NONFINITE[node["v"]]
            if tag == "size":
                return torch.Size(node["v"])
            if tag == "bytes":
                return base64.b64decode(node["v"], validate=True)
            if tag == "tensor":
                return self._tensor(node, path)
            if tag in ("ndarray", "np_scalar"):
                return self._numpy(node, path)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise self._bad(path, f"{tag!r} node is malformed ({type(exc).__name__}: {exc})") from exc
        raise self._bad(path, f"unknown node type {tag!r}")

    def _dict(self, node: dict, path: tuple) -> dict:
        out: dict = OrderedDict() if node.get("ordered") else {}
        for key, value in node["items"]:
            if type(key) not in (str, int):
                raise self._bad(path, f"dict key {key!r} is not str or int")
            out[key] = self.node(value, path + (key,))
        if "metadata" in node:
            out._metadata = self.node(node["metadata"], path + ("_metadata",))  # type: ignore[attr-defined]
        return out

    def _tensor(self, node: dict, path: tuple) -> torch.Tensor:
        t = self._get(node["k"], path)
        if "dtype" in node:  # stored as raw bytes: reinterpret
            dtype = dtype_named(node["dtype"])
            if dtype is None:
                raise self._bad(path, f"unknown torch dtype {node['dtype']!r}")
            t = t.view(dtype).reshape(node["shape"])
        return t

    def _numpy(self, node: dict, path: tuple) -> Any:
        try:
            import numpy as np
        except ImportError as exc:
            raise CheckpointError(
                f"the checkpoint holds a numpy value at {_path_str(path)!r}; install numpy to load it"
            ) from exc
        dtype = np.dtype(node["dtype"])
        if dtype.hasobject:
            raise self._bad(path, f"numpy dtype {dtype} holds python objects")
        if node["t"] == "np_scalar":
            return np.frombuffer(base64.b64decode(node["v"], validate=True), dtype=dtype)[0]
        raw = self._get(node["k"], path).numpy().tobytes()
        return np.frombuffer(raw, dtype=dtype).reshape(node["shape"]).copy()

    def _get(self, name: Any, path: tuple) -> torch.Tensor:
        t = self._tensors.get(name) if isinstance(name, str) else None
        if t is None:
            raise self._bad(path, f"tensor {name!r} is missing from the tensor file")
        return t

    @staticmethod
    def _bad(path: tuple, what: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"state spec at {_path_str(path)!r}: {what}")
