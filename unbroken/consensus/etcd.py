"""A small, typed etcd v3 client over etcd's own JSON gateway (stdlib ``http.client`` only).

Why not a library: ``etcd3`` (0.12.0, 2020) is unmaintained and pins old grpcio/protobuf;
``aetcd`` is asyncio-only (our controller runs in threads); ``etcd-client-py`` is a young
(0.5.x) binding to a Rust client. etcd serves its v3 API as JSON over HTTP on the client port
(``/v3/kv/range``, ``/v3/kv/txn``, ``/v3/lease/grant``, ...), stable since etcd 3.4, so the
few calls we need cost no dependency: keys and values go base64-encoded, int64 fields as
strings.

:class:`EtcdClient` owns only the endpoint list and the index of the one that answered last;
each call is one HTTP request (a fresh connection: no shared socket between threads), tried
on every endpoint in turn when one is unreachable. A call that etcd itself refuses (a bad
request, a lost lease) is not retried elsewhere: it raises :class:`EtcdError`. Reads are
linearizable (etcd's default), so a member cut off from the quorum cannot answer one.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence
from urllib.parse import urlsplit

from unbroken.errors import ConfigError, UnbrokenError

__all__ = ["Compare", "DeleteRange", "EtcdClient", "EtcdError", "EtcdUnavailable", "KeyValue", "Put", "TxnResult",
           "parse_endpoints"]


class EtcdError(UnbrokenError):
    """etcd answered, and refused the request (the message is etcd's)."""


class EtcdUnavailable(EtcdError):
    """No endpoint of the etcd cluster answered (all unreachable, or no quorum in time)."""


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction: ``target`` of ``key`` compared (``result``) to ``value``.
    target: ``CREATE`` (create_revision; 0 = the key is absent), ``MOD``, ``VERSION``, ``VALUE``."""
    key: bytes
    target: str = "CREATE"
    value: int | bytes = 0
    result: str = "EQUAL"

    def to_json(self) -> dict[str, Any]:
        field = {"CREATE": "create_revision", "MOD": "mod_revision", "VERSION": "version",
                 "VALUE": "value"}[self.target]
        value = _b64(self.value) if isinstance(self.value, bytes) else str(self.value)
        return {"key": _b64(self.key), "target": self.target, "result": self.result, field: value}


@dataclass(frozen=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"key": _b64(self.key), "value": _b64(self.value)}
        if self.lease:
            body["lease"] = str(self.lease)
        return {"request_put": body}


@dataclass(frozen=True)
class DeleteRange:
    """Delete the keys in [``key``, ``range_end``)."""
    key: bytes
    range_end: bytes

    def to_json(self) -> dict[str, Any]:
        return {"request_delete_range": {"key": _b64(self.key), "range_end": _b64(self.range_end)}}


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int  # the store's revision after the transaction
    kvs: tuple[KeyValue, ...]  # what the failure branch's reads found (empty on success)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _kv(item: dict[str, Any]) -> KeyValue:
    return KeyValue(key=base64.b64decode(item["key"]), value=base64.b64decode(item.get("value", "")),
                    create_revision=int(item.get("create_revision", 0)),
                    mod_revision=int(item.get("mod_revision", 0)), lease=int(item.get("lease", 0)))


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with ``prefix`` (etcd's convention)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """``etcd://host:port[,host:port...]`` (or ``http://``) -> [(host, port), ...]."""
    scheme, sep, rest = spec.partition("://")
    if not sep or scheme not in ("etcd", "http"):
        raise ConfigError(f"--controller-store {spec!r}: expected etcd://HOST:PORT[,HOST:PORT...] "
                          "(plain HTTP to etcd's client port; TLS and auth are not supported yet)")
    out = []
    for part in rest.strip("/").split(","):
        url = urlsplit(f"http://{part}")
        if not url.hostname or not url.port or url.path:
            raise ConfigError(f"--controller-store {spec!r}: {part!r} is not HOST:PORT")
        out.append((url.hostname, url.port))
    return out


class EtcdClient:
    """etcd's v3 API for one cluster (see the module docstring). Thread-safe."""

    def __init__(self, endpoints: Sequence[tuple[str, int]] | str, *, timeout_s: float = 2.0) -> None:
        self.endpoints = parse_endpoints(endpoints) if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise ConfigError("an etcd client needs at least one endpoint")
        if timeout_s <= 0:
            raise ConfigError(f"etcd timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._current = 0  # index of the endpoint that answered last

    # -- transport -------------------------------------------------------------------------
    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first endpoint that answers."""
        data = json.dumps(body).encode()
        with self._lock:
            start = self._current
        failures = []
        for i in range(len(self.endpoints)):
            index = (start + i) % len(self.endpoints)
            host, port = self.endpoints[index]
            conn = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
            try:
                conn.request("POST", f"/v3/{path}", body=data, headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                payload = response.read()
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, cut off: the next member
                failures.append(f"{host}:{port}: {exc}")
                continue
            finally:
                conn.close()
            try:
                answer = json.loads(payload or b"{}")
            except ValueError:
                raise EtcdError(f"etcd {host}:{port} /v3/{path}: not JSON (HTTP {response.status})") from None
            if response.status >= 500 and _retryable(answer):
                failures.append(f"{host}:{port}: {answer.get('message')}")
                continue
            if response.status != 200 or "error" in answer:
                raise EtcdError(f"etcd {host}:{port} /v3/{path}: {answer.get('message') or answer.get('error')} "
                                f"(HTTP {response.status})")
            with self._lock:
                self._current = index
            return answer
        raise EtcdUnavailable(f"no etcd member answered /v3/{path}: " + "; ".join(failures))

    # -- key-value -------------------------------------------------------------------------
    def get(self, key: bytes) -> KeyValue | None:
        kvs = self.range(key)
        return kvs[0] if kvs else None

    def range(self, key: bytes, range_end: bytes | None = None) -> list[KeyValue]:
        body = {"key": _b64(key)}
        if range_end is not None:
            body["range_end"] = _b64(range_end)
        return [_kv(item) for item in self.call("kv/range", body).get("kvs", [])]

    def get_prefix(self, prefix: bytes) -> list[KeyValue]:
        return self.range(prefix, prefix_end(prefix))

    def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Unconditional put; the new revision."""
        body = Put(key, value, lease).to_json()["request_put"]
        return int(self.call("kv/put", body)["header"]["revision"])

    def delete(self, key: bytes) -> None:
        self.call("kv/deleterange", {"key": _b64(key)})

    def txn(self, compare: Iterable[Compare], success: Iterable[Put | DeleteRange], *,
            failure_reads: Iterable[bytes] = ()) -> TxnResult:
        """If every ``compare`` holds, apply ``success`` (atomically); else read ``failure_reads``."""
        answer = self.call("kv/txn", {
            "compare": [c.to_json() for c in compare],
            "success": [p.to_json() for p in success],
            "failure": [{"request_range": {"key": _b64(k)}} for k in failure_reads]})
        kvs: list[KeyValue] = []
        if not answer.get("succeeded"):
            for response in answer.get("responses", []):
                kvs += [_kv(item) for item in response.get("response_range", {}).get("kvs", [])]
        return TxnResult(bool(answer.get("succeeded")), int(answer["header"]["revision"]), tuple(kvs))

    # -- leases ----------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        if ttl_s < 1:
            raise ConfigError(f"an etcd lease TTL is whole seconds >= 1, got {ttl_s}")
        return int(self.call("lease/grant", {"TTL": str(ttl_s)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Refresh ``lease`` once; its remaining TTL in seconds, 0 when it has already expired."""
        answer = self.call("lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """Drop ``lease`` and the keys attached to it; an unknown lease is not an error."""
        try:
            self.call("lease/revoke", {"ID": str(lease)})
        except EtcdUnavailable:
            raise
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise

    def status(self) -> dict[str, Any]:
        return self.call("maintenance/status", {})


def _retryable(answer: dict[str, Any]) -> bool:
    """etcd's 5xx answers that another member may not share (no leader, timeout, stopping)."""
    text = str(answer.get("message", "")).lower()
    return any(word in text for word in ("no leader", "timed out", "timeout", "stopped", "unavailable",
                                         "not capable", "leader changed"))
