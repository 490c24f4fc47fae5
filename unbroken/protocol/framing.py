"""Frames of the control plane: a 4-byte big-endian length, then a msgpack map.

Never pickle. A frame over MAX_FRAME_BYTES is refused from its header, before its body is
read. `FrameReader` keeps partial input across timeouts, so a `recv` that times out in the
middle of a frame loses nothing. Used by wire.py, which re-exports these names.
"""

from __future__ import annotations

import math
import select
import socket
import struct
import threading
import time
from typing import Any

import msgpack

from unbroken.errors import ConnectionClosed, ProtocolError

MAX_FRAME_BYTES = 1 << 20
MAX_DEPTH = 32  # nesting of maps and arrays in one frame; ours nest a few levels
WAKE_S = 0.5  # a blocked read re-checks whether its connection was closed this often

_HEADER = struct.Struct(">I")
_RECV_CHUNK_BYTES = 64 * 1024


def pack_frame(obj: dict[str, Any]) -> bytes:
    """`obj` as one frame (header + msgpack payload); ProtocolError if it cannot be sent."""
    try:
        payload = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot pack control frame {obj.get('type')!r}: {exc}") from None
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"control frame {obj.get('type')!r} is {len(payload)} bytes, "
            f"over the {MAX_FRAME_BYTES}-byte limit"
        )
    return _HEADER.pack(len(payload)) + payload


def unpack_payload(payload: bytes) -> dict[str, Any]:
    """The msgpack map in `payload`; ProtocolError for anything else."""
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_FRAME_BYTES,
            max_str_len=MAX_FRAME_BYTES,
            max_array_len=1 << 16,
            max_map_len=1 << 12,
            max_ext_len=0,  # no extension types, timestamps included
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"malformed control frame: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        kind = type(obj).__name__
        raise ProtocolError(f"malformed control frame: payload is a msgpack {kind}, not a map")
    _check_depth(obj)
    return obj


def _check_depth(obj: Any) -> None:
    """ProtocolError if maps and arrays nest deeper than MAX_DEPTH. Iterative, so no frame can
    make anything after it (the handshake's MAC input, message checks) recurse too deep."""
    todo = [(obj, 1)]
    while todo:
        value, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ProtocolError(f"malformed control frame: nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            todo.extend((v, depth + 1) for v in value.values() if isinstance(v, (dict, list)))
        elif isinstance(value, list):
            todo.extend((v, depth + 1) for v in value if isinstance(v, (dict, list)))


class FrameReader:
    """Reads whole frames from a blocking socket; keeps partial input across timeouts.

    Owned by one Connection; callers serialise `read`. Waits with poll() in slices of
    WAKE_S so that `closed` being set ends a read promptly.
    """

    def __init__(
        self, sock: socket.socket, peer: str, closed: threading.Event | None = None
    ) -> None:
        self._sock = sock
        self._peer = peer
        self._closed = closed or threading.Event()
        self._buf = bytearray()
        self.out_of_step = False  # set once a bad header leaves no way to find the next frame
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN | select.POLLPRI)

    def read(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The next frame's map. TimeoutError, ConnectionClosed or ProtocolError otherwise."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            payload = self._take_frame()
            if payload is not None:
                try:
                    return unpack_payload(payload)
                except ProtocolError as exc:  # the stream is still in step: the frame was whole
                    raise ProtocolError(f"control connection {self._peer}: {exc}") from None
            self._fill(deadline, timeout_s)

    @property
    def buffered(self) -> int:
        """Bytes read from the socket and not handed out yet."""
        return len(self._buf)

    def _take_frame(self) -> bytes | None:
        if len(self._buf) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self._buf)
        if length > MAX_FRAME_BYTES:
            self.out_of_step = True
            raise ProtocolError(
                f"control connection {self._peer}: frame announces {length} bytes, "
                f"over the {MAX_FRAME_BYTES}-byte limit"
            )
        end = _HEADER.size + length
        if len(self._buf) < end:
            return None
        payload = bytes(self._buf[_HEADER.size : end])
        del self._buf[:end]
        return payload

    def _fill(self, deadline: float | None, timeout_s: float | None) -> None:
        while True:
            if self._closed.is_set():
                raise ConnectionClosed(f"control connection {self._peer} was closed")
            wait_s = WAKE_S if deadline is None else min(WAKE_S, deadline - time.monotonic())
            if self._poll.poll(math.ceil(max(wait_s, 0.0) * 1000)):
                break  # always polled once, so timeout_s=0 still picks up waiting input
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no complete message from {self._peer} within {timeout_s} s")
        try:
            chunk = self._sock.recv(_RECV_CHUNK_BYTES)
        except OSError as exc:
            raise ConnectionClosed(f"control connection {self._peer} failed: {exc}") from None
        if not chunk:
            where = " in the middle of a frame" if self._buf else ""
            raise ConnectionClosed(f"control connection {self._peer} closed by the peer{where}")
        self._buf += chunk
