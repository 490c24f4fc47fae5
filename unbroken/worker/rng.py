"""The process's random-number state as training state: captured and restored exactly.

torch (CPU, and CUDA when initialized), Python's ``random`` and, when the script imported
it, numpy. The captured form holds tensors and plain values only, so the state tree
and the replica transfer carry it without pickle.

A generator the script owns (a ``torch.Generator``, a numpy ``Generator``/``RandomState``, a
``random.Random``) is tracked through a :class:`GeneratorState` (per rank, like the streams).

:func:`capture`/:func:`restore` read and set the streams once (checkpoints, transfers). A
:class:`StreamReader` does the same for the reads of every step (worker/rollback.py), where
the cost counts: it converts a stream again only when it moved since its last read.
"""

from __future__ import annotations

import _random
import array
import ctypes
import random
import struct
import sys
from typing import Any

import torch

#: A Mersenne Twister's state as numpy and CPython hold it: 624 uint32 words and an int position.
_MT_STATE_BYTES = 624 * 4 + 4
#: torch's CPU generator in memory (CPUGeneratorImpl after its GeneratorImpl base): the mt19937 data
#: (uint64 seed, int left, bool seeded, uint32 next, 624 uint32 words) and the two cached normal
#: samples (optional<float>, optional<double>). Checked against get_rng_state() for these versions.
_TORCH_ENGINE_BYTES = 2544
_TORCH_WORDS_AT = 20  # the 624 words, from the start of the engine data
_TORCH_FLOAT_SAMPLE_AT, _TORCH_DOUBLE_SAMPLE_AT = 2520, 2528  # each: the value, then "engaged"
_TORCH_LAYOUT_CHECKED = frozenset({(2, 13)})


def capture() -> dict[str, Any]:
    return portable(StreamReader().capture())


def portable(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a :meth:`StreamReader.capture`) with torch's stream as ``get_rng_state()`` gives it,
    the form checkpoint files keep (a reader's form may be the engine's memory, see ``torch_state``)."""
    torch_form, python_form = state["torch"], state["python"]
    if isinstance(torch_form, torch.Tensor) and not isinstance(python_form[1], bytes):
        return state
    version, internal, gauss = _python_state(python_form)
    words = torch.frombuffer(array.array("q", internal), dtype=torch.int64)
    return {**state, "torch": torch_state(torch_form), "python": [version, words, gauss]}


def torch_state(form: torch.Tensor | bytes) -> torch.Tensor:
    """torch's CPU stream as ``torch.get_rng_state()`` gives it, from either captured form: that
    tensor, or the bytes of the generator's memory read through its view (``_TORCH_ENGINE_BYTES``,
    the layout of the torch versions in ``_TORCH_LAYOUT_CHECKED``; see ``_legacy_from_engine``)."""
    if isinstance(form, torch.Tensor):
        return form
    if not isinstance(form, bytes) or len(form) != _TORCH_ENGINE_BYTES:
        raise ValueError(f"torch's RNG state is {type(form).__name__} of {len(form) if isinstance(form, bytes) else '?'} "
                         f"bytes: expected get_rng_state()'s tensor or the {_TORCH_ENGINE_BYTES} bytes of the engine")
    return torch.frombuffer(bytearray(_legacy_from_engine(form)), dtype=torch.uint8)


def _python_state(form: list) -> tuple:
    """``random.getstate()`` of a captured form: [version, words, gauss_next] with the words as a
    tensor of the 625 ints (checkpoints; a list in older ones) or as the generator's memory read
    through its view (bytes: the int position, then 624 uint32 words; see ``_python_words``)."""
    version, internal, gauss = form
    if isinstance(internal, bytes):
        words = struct.unpack_from("<624I", internal, 4) + struct.unpack_from("<i", internal, 0)
    else:
        words = tuple(internal.tolist() if isinstance(internal, torch.Tensor) else internal)
    return version, words, gauss


def restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch_state(state["torch"]))
    random.setstate(_python_state(state["python"]))
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, gauss_value = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss_value))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class StreamReader:
    """Reads the RNG streams for the per-step captures of one rank; lives in its training thread
    (owned by its :class:`~unbroken.worker.tracked.TrackedState`).

    The captured form of a stream that did not move since the last read is reused (shared:
    callers copy before they mutate), so a stream the script does not draw from costs next to
    nothing. Whether a stream moved is told by its raw state in memory, read through a
    :class:`_StateWords` view (a 2.5 KB copy) instead of ``torch.get_rng_state()`` (a tensor made
    through the dispatcher), ``random.getstate()`` (625 ints) or ``np.random.get_state()`` (a
    Python loop over 624 words: ~50 us, several times that on a loaded machine). For torch and
    Python the view's bytes are also the captured form (converted to what ``set_rng_state`` /
    ``random.setstate`` take only when a stream is set, and by :func:`portable` for checkpoint
    files), so a moved stream costs one copy of its memory, not a full read. Their views are
    checked when made (the state they hold equals the real one, and they move with a draw); torch's
    only for the versions whose layout was checked (``_TORCH_LAYOUT_CHECKED``; others: full reads).
    numpy's view is checked against the real state on every full read. A view that does not match
    is dropped for good and that stream is read in full from then on.
    ``put_back`` sets torch's stream only when its view says it moved.

    Python's fingerprint is complete (its words, position and ``gauss_next``). numpy's lacks
    the legacy pending Gaussian (``has_gauss``/``gauss``), so a numpy state with one pending is
    always read in full, and one without is reused only while its words and position are
    unchanged (drawing a Gaussian moves them). Blind spot: a script that calls
    ``np.random.set_state`` with the current words and position and a pending Gaussian added.
    """

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()  # fixed for the process; is_initialized() is not
        self._torch_view: _StateWords | None = None
        self._torch_viewable = True  # False once no view could be made (or one did not match)
        self._torch_mark: bytes | None = None  # the view's bytes at the last full read
        self._torch_form: torch.Tensor | None = None  # ... its get_rng_state()
        self._python_view: _StateWords | None = _python_words()
        self._python_mark: tuple | None = None  # (the view's bytes, gauss_next) of the last read
        self._python_form: list | None = None  # ... as captured
        self._numpy_view: _StateWords | None = None
        self._numpy_viewable = True  # False once a numpy view did not match get_state()
        self._numpy_mark: bytes | None = None  # the words of the last full read
        self._numpy_form: list | None = None

    def capture(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": self._torch(), "python": self._python()}
        np = sys.modules.get("numpy")
        if np is not None:
            state["numpy"] = self._numpy(np)
        if self._cuda and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def put_back(self, state: dict[str, Any]) -> None:
        """Set torch's CPU stream and Python's (if it moved) back to ``state``, this reader's last
        :meth:`capture`: what reading an object's state must not change."""
        view = self._torch_view
        if view is None or state["torch"] is not self._torch_form or view.read() != self._torch_mark:
            torch.set_rng_state(torch_state(state["torch"]))
        if self._python_view is None or self._python_now() != self._python_mark:
            random.setstate(_python_state(state["python"]))

    def restore(self, state: dict[str, Any]) -> None:
        restore(state)
        self.forget()

    def forget(self) -> None:
        """Drop the reused forms: the next read reads every stream in full."""
        self._torch_mark = self._torch_form = None
        self._python_mark = self._python_form = None
        self._numpy_mark = self._numpy_form = None

    # -- torch's CPU generator ---------------------------------------------------------------
    def _torch(self) -> torch.Tensor | bytes:
        """The stream's form: with a view, the view's bytes themselves (no torch call, and bytes the
        encoder copies as they are; :func:`torch_state` makes get_rng_state()'s tensor of them when
        it is set); without one, get_rng_state()."""
        if self._torch_view is None and self._torch_viewable:
            self._torch_view = _torch_words()
            self._torch_viewable = self._torch_view is not None
        view = self._torch_view
        if view is None:
            self._torch_form = torch.get_rng_state()
            return self._torch_form
        mark = view.read()
        if mark != self._torch_mark or self._torch_form is None:
            self._torch_mark = self._torch_form = mark
        return self._torch_form

    # -- Python's random -------------------------------------------------------------------
    def _python_now(self) -> tuple:
        assert self._python_view is not None
        return self._python_view.read(), random.getstate.__self__.gauss_next

    def _python(self) -> list:
        """The stream's form: with a view, [version, the view's bytes, gauss_next] (no 625-int tuple
        made; :func:`_python_state` makes one when it is set); without one, random.getstate()."""
        if self._python_view is None:
            version, internal, gauss = random.getstate()
            # The 625 words as one tensor: the state tree stores it as bytes, not 625 JSON numbers.
            return [version, torch.frombuffer(array.array("q", internal), dtype=torch.int64), gauss]
        mark = self._python_now()
        if mark != self._python_mark or self._python_form is None:
            self._python_mark, self._python_form = mark, [random.Random.VERSION, mark[0], mark[1]]
        return self._python_form

    # -- numpy's global RandomState -----------------------------------------------------------
    def _numpy(self, np: Any) -> list:
        view = self._numpy_words(np) if self._numpy_viewable else None
        mark = view.read() if view is not None else None
        form = self._numpy_form
        if mark is not None and mark == self._numpy_mark and form is not None and not form[3]:
            return form
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        if mark is not None and mark != keys.astype("uint32").tobytes() + array.array("i", [pos]).tobytes():
            self._numpy_viewable, self._numpy_view, mark = False, None, None  # not the layout we know
        self._numpy_mark = mark
        self._numpy_form = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss)]
        return self._numpy_form

    def _numpy_words(self, np: Any) -> _StateWords | None:
        """A view of the global RandomState's MT19937 state (mt19937_state: 624 uint32 words, then
        the int position) through numpy's public ctypes interface; None where numpy has none
        (before 1.25) or the global generator is another bit generator."""
        get_bit_generator = getattr(np.random, "get_bit_generator", None)
        bit_generator = get_bit_generator() if get_bit_generator is not None else None
        if self._numpy_view is not None and self._numpy_view.owner is bit_generator:
            return self._numpy_view
        if type(bit_generator).__name__ != "MT19937":
            return None
        self._numpy_view = _StateWords(bit_generator, bit_generator.ctypes.state_address)
        return self._numpy_view


class _StateWords:
    """A read-only view of a generator's raw state in this process's memory (for numpy and
    CPython: 624 uint32 words and an int position, ``_MT_STATE_BYTES``), kept with the object
    that owns it so the memory stays valid. Read as bytes only to tell whether the state moved;
    the reader checks each view against the generator's own state before trusting it."""

    def __init__(self, owner: Any, address: int, size_bytes: int = _MT_STATE_BYTES) -> None:
        self.owner = owner
        self._words = (ctypes.c_char * size_bytes).from_address(address)

    def read(self) -> bytes:
        return self._words.raw


def _python_words() -> _StateWords | None:
    """A view of the MT state of the generator behind ``random.getstate`` (CPython's
    ``RandomObject``: after the object header, the int position, then 624 uint32 words), or
    None where that generator is not a C ``_random.Random`` big enough to hold them, or where the
    memory does not hold what getstate() says or does not move with a draw (the draw is undone)."""
    owner = getattr(random.getstate, "__self__", None)
    header_bytes = object.__basicsize__
    if not isinstance(owner, _random.Random) or _random.Random.__basicsize__ < header_bytes + _MT_STATE_BYTES:
        return None
    view = _StateWords(owner, id(owner) + header_bytes)
    saved = random.getstate()
    form = [saved[0], view.read(), saved[2]]
    if _python_state(form) != saved:
        return None
    random.getrandbits(32)
    moved = _python_state([saved[0], view.read(), saved[2]]) == random.getstate() != saved
    random.setstate(saved)
    return view if moved and view.read() == form[1] else None


def _torch_words() -> _StateWords | None:
    """A view of torch's default CPU generator's state in memory (``_TORCH_ENGINE_BYTES`` from its
    mt19937 data on), or None: for a torch whose layout was not checked, or where the memory does
    not hold what get_rng_state() says (its words, seed, position, cached normal samples) or does
    not move with a draw. The draw is undone: the stream is where it was. The view also covers
    padding and a disengaged sample's stale value: those may change with no change of state, which
    only makes the reader read in full once more, never miss a move."""
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) not in _TORCH_LAYOUT_CHECKED:
        return None
    generator = torch.default_generator
    impl = ctypes.c_void_p.from_address(id(generator) + object.__basicsize__).value  # THPGenerator.cdata
    if not impl or impl % 8:
        return None
    saved = torch.get_rng_state()
    legacy = saved.numpy().tobytes()
    words = struct.pack("<624I", *struct.unpack_from("<624Q", legacy, 24))
    found = ctypes.string_at(impl, 512).find(words[:64])  # the engine data lie in the object's first bytes
    engine_at = found - _TORCH_WORDS_AT
    if found < 0 or engine_at < 8 or engine_at % 8:
        return None
    view = _StateWords(generator, impl + engine_at, _TORCH_ENGINE_BYTES)
    before = view.read()
    if _legacy_from_engine(before) != legacy:
        return None
    torch.rand(1, device="cpu")
    moved = view.read() != before and _legacy_from_engine(view.read()) == torch.get_rng_state().numpy().tobytes()
    torch.set_rng_state(saved)  # (padding and a disengaged sample's bytes may differ now: no matter)
    return view if moved and _legacy_from_engine(view.read()) == legacy else None


def _legacy_from_engine(raw: bytes) -> bytes:
    """get_rng_state()'s bytes (CPUGeneratorImplState: uint64 seed, int left, int seeded, uint64 next,
    624 uint64 words, doubles x, y, rho, int y-valid, padding; float, bool, padding: 5056 bytes) of
    the generator's memory ``raw`` (uint64 seed, int left, bool seeded, uint32 next, 624 uint32 words,
    optional<float>, optional<double>). A disengaged sample and the padding are zeros, as torch writes
    them; their bytes in ``raw`` (stale values) do not count."""
    seed, left, seeded, next_ = struct.unpack_from("<Qi?3xI", raw, 0)
    float_sample, float_valid = struct.unpack_from("<f?", raw, _TORCH_FLOAT_SAMPLE_AT)
    double_sample, double_valid = struct.unpack_from("<d?", raw, _TORCH_DOUBLE_SAMPLE_AT)
    return (struct.pack("<QiiQ", seed, left, seeded, next_)
            + struct.pack("<624Q", *struct.unpack_from("<624I", raw, _TORCH_WORDS_AT))
            + struct.pack("<dddi4x", 0.0, double_sample if double_valid else 0.0, 0.0, double_valid)
            + struct.pack("<f?3x", float_sample if float_valid else 0.0, float_valid))


class GeneratorState:
    """A tracked ``torch.Generator``, numpy ``Generator``/``RandomState`` or ``random.Random``: its state as
    a state dict (numpy's integers past 64 bits as text, its arrays as tensors: what the state tree holds)."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        g = self.generator
        if isinstance(g, torch.Generator):
            return {"torch": g.get_state()}
        if isinstance(g, random.Random):
            version, words, gauss = g.getstate()
            return {"python": [version, list(words), gauss]}
        state = g.bit_generator.state if hasattr(g, "bit_generator") else g.get_state(legacy=False)
        return {"numpy": _to_tree(state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        g = self.generator
        if isinstance(g, torch.Generator):
            g.set_state(state["torch"])
        elif isinstance(g, random.Random):
            version, words, gauss = state["python"]
            g.setstate((version, tuple(words), gauss))
        elif hasattr(g, "bit_generator"):
            g.bit_generator.state = _from_tree(state["numpy"])
        else:
            g.set_state(_from_tree(state["numpy"]))


def is_generator(obj: Any) -> bool:
    """A torch, numpy or Python random generator a script owns (tracked as a GeneratorState)."""
    np = sys.modules.get("numpy")
    return isinstance(obj, (torch.Generator, random.Random)) or (
        np is not None and isinstance(obj, (np.random.Generator, np.random.RandomState)))


def _to_tree(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _to_tree(v) for k, v in x.items()}
    if isinstance(x, int) and not isinstance(x, bool) and not -2**63 <= x < 2**63:
        return {"__int__": str(x)}
    if type(x).__module__ == "numpy" and hasattr(x, "dtype"):  # an array or a numpy scalar
        return {"__ndarray__": torch.from_numpy(x.copy()) if x.ndim else torch.tensor(x.item())}
    return x


def _from_tree(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"__int__"}:
            return int(x["__int__"])
        if set(x) == {"__ndarray__"}:
            return x["__ndarray__"].numpy().copy()
        return {k: _from_tree(v) for k, v in x.items()}
    return x
