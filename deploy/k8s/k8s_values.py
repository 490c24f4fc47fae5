"""The values of deploy/k8s/render.py: read (the defaults in ``values.yaml`` beside this file,
then each ``--values`` file, then each ``--set KEY=VALUE``), checked key by key, and the sizes and
names derived from them (the /dev/shm size, the controller's and etcd's hosts, the grace period).

A bad value raises RenderError naming the key, the value and what is allowed; render.py, which
builds the manifests and the command line from these values, turns it into exit 2; the tests
(tests/deploy/test_k8s_manifests.py) load it too. Imports unbroken only for the /dev/shm size.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent

# MindCluster's label values -> ours (seeds: `subHealthyStrategy: graceExit`, `fault-scheduling: grace`).
SUB_HEALTHY = {"ignore": "ignore", "graceExit": "grace-exit"}
# fault-scheduling: how a failed or evicted pod is handled. grace: SIGTERM and time to stop cleanly,
# then new pods; force: the same with a short grace; off: no new pods, the JobSet fails.
FAULT_SCHEDULING = {"grace": 60, "force": 5, "off": 60}
# What a pod needs after its SIGTERM dump, within terminationGracePeriodSeconds: the workers' stop
# grace (3 s), the final pass of the persister, the agent's exit. The dump gets the rest.
STOP_AFTER_DUMP_S = 10

_QUANTITY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
          "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_FREE_FORM = {"resources", "nodeSelector"}  # Kubernetes' own structures, passed on as they are
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class RenderError(ValueError):
    """A value that cannot be rendered; the message names the key, the value and what is allowed."""


# ----------------------------------------------------------------------------- values

def load_values(files: list[str], sets: list[str]) -> dict[str, Any]:
    """The defaults, overridden by each file in order, then by each KEY=VALUE."""
    values = _read_yaml(HERE / "values.yaml")
    for path in files:
        _merge(values, _read_yaml(Path(path)), where=path)
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RenderError(f"--set {item!r}: give KEY=VALUE, e.g. --set nodes=4")
        tree: dict[str, Any] = {}
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(raw) if raw else ""
        _merge(values, tree, where=f"--set {item}")
    return values


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RenderError(f"cannot read the values file {str(path)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise RenderError(f"the values file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise RenderError(f"the values file {str(path)!r} must hold a mapping of keys")
    return data


def _merge(into: dict[str, Any], new: dict[str, Any], *, where: str, prefix: str = "", strict: bool = True) -> None:
    """Values of `new` over `into`; a key the defaults do not have is a typo (RenderError),
    except inside Kubernetes' own structures (resources, nodeSelector)."""
    for key, value in new.items():
        if strict and key not in into:
            raise RenderError(f"{where}: unknown key {prefix + key!r} (known here: {', '.join(into)})")
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, where=where, prefix=f"{prefix}{key}.",
                   strict=strict and key not in _FREE_FORM)
        else:
            into[key] = value


def parse_quantity(key: str, value: Any) -> int:
    """A Kubernetes quantity (``512Mi``, ``6Gi``, ``1000000``) in bytes."""
    match = _QUANTITY.match(str(value))
    if match is None:
        raise RenderError(f"{key}: {value!r} is not a byte quantity (allowed: a whole number with "
                          "an optional suffix Ki, Mi, Gi, Ti, k, M, G or T, e.g. 6Gi)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def _int(values: dict[str, Any], key: str, *, low: int, high: int = 2**31 - 1) -> int:
    node = _lookup(values, key)
    if isinstance(node, bool) or not isinstance(node, int) or not low <= node <= high:
        raise RenderError(f"{key}: {node!r} must be a whole number in [{low}, {high}]")
    return node


def _lookup(values: dict[str, Any], key: str) -> Any:
    node: Any = values
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise RenderError(f"{key}: missing (see deploy/k8s/values.yaml for every key)")
        node = node[part]
    return node


def _choice(values: dict[str, Any], key: str, allowed: dict[str, Any]) -> Any:
    raw = _lookup(values, key)
    if raw is False and "off" in allowed:  # YAML 1.1 reads a bare `off` as false
        raw = values[key] = "off"
    if raw not in allowed:
        raise RenderError(f"{key}: unknown value {raw!r} (allowed: {', '.join(allowed)})")
    return allowed[raw]


def check_values(values: dict[str, Any]) -> None:
    """Check the values the manifests are built from (the command line is checked afterwards)."""
    for key in ("name", "namespace"):
        raw = _lookup(values, key)
        limit = 40 if key == "name" else 63  # name: room for "-controller" and JobSet's suffixes
        if not isinstance(raw, str) or len(raw) > limit or not _DNS_LABEL.match(raw):
            raise RenderError(f"{key}: {raw!r} must be a DNS label: lower-case letters, digits and '-', "
                              f"at most {limit} characters")
    for key in ("image", "script", "secretName", "workingDir"):
        raw = _lookup(values, key)
        if not isinstance(raw, str) or not raw:
            raise RenderError(f"{key}: {raw!r} must be a non-empty string")
    _int(values, "nodes", low=1)
    _int(values, "procPerNode", low=1)
    _int(values, "standbyNodes", low=0)
    _int(values, "controlPort", low=1, high=65535)
    _int(values, "metricsPort", low=0, high=65535)
    _int(values, "jobsetMaxRestarts", low=0)
    if values["metricsPort"] == values["controlPort"]:
        raise RenderError(f"metricsPort: {values['metricsPort']} is also controlPort; give two different ports")
    _choice(values, "subHealthyStrategy", SUB_HEALTHY)
    strategies = [part.strip() for part in str(values["recoverStrategy"]).split(",")]
    if "elastic" in strategies or "elastic-training" in strategies:
        # The node Job has backoffLimit 0 and the JobSet restarts every pod when one fails: a pod lost to
        # a node would end the survivors' elastic continuation. Say so rather than render a manifest that
        # cannot do what the flag asks.
        raise RenderError(f"recoverStrategy: {values['recoverStrategy']!r}: rung elastic (go on on the nodes "
                          "left) is not supported by this manifest yet: its JobSet restarts every pod when a "
                          "node pod fails. Use standbyNodes (rung recover) or leave elastic out (a node loss "
                          "then restarts the JobSet from the newest checkpoint)")
    _choice(values, "faultScheduling", FAULT_SCHEDULING)
    grace = values.get("terminationGracePeriodSeconds")
    if grace is not None and (isinstance(grace, bool) or not isinstance(grace, int) or grace < 5):
        raise RenderError(f"terminationGracePeriodSeconds: {grace!r} must be null or a whole number >= 5 "
                          "(unbroken run needs a few seconds to stop its workers)")
    dump = values.get("sigtermDumpTimeoutSeconds")
    room = max(0, termination_grace_s(values) - STOP_AFTER_DUMP_S)
    if dump is not None and (isinstance(dump, bool) or not isinstance(dump, (int, float)) or not 0 <= dump <= room):
        raise RenderError(f"sigtermDumpTimeoutSeconds: {dump!r} must be null or a number of seconds in [0, {room}]: "
                          f"the dump, then {STOP_AFTER_DUMP_S} s to stop, must fit in terminationGracePeriodSeconds "
                          f"({termination_grace_s(values)}); raise that, or give less")
    for key in ("scriptArgs", "extraArgs", "env", "tolerations"):
        if not isinstance(values.get(key), list):
            raise RenderError(f"{key}: {values.get(key)!r} must be a list")
    for key in ("resources", "nodeSelector", "storage", "memoryTier"):
        if not isinstance(values.get(key), dict):
            raise RenderError(f"{key}: {values.get(key)!r} must be a mapping")
    mount = _lookup(values, "storage.mountPath")
    if not isinstance(mount, str) or not mount.startswith("/") or mount.rstrip("/") in ("", "/dev/shm"):
        raise RenderError(f"storage.mountPath: {mount!r} must be an absolute path other than / and /dev/shm")
    for key in ("memoryTier.stateBytesPerRank", "memoryTier.extraBytes"):
        parse_quantity(key, _lookup(values, key))
    _int(values, "memoryTier.everySteps", low=0)
    _check_memory_limit(values)
    _check_failover(values)


def _check_failover(values: dict[str, Any]) -> None:
    failover = _lookup(values, "controllerFailover")
    if not isinstance(failover, dict) or not isinstance(failover.get("enabled"), bool):
        raise RenderError(f"controllerFailover.enabled: {_lookup(values, 'controllerFailover.enabled')!r} must be "
                          "true or false")
    _int(values, "controllerFailover.leaseSeconds", low=1, high=60)
    if _int(values, "controllerFailover.etcd.members", low=1, high=5) % 2 == 0:
        raise RenderError(f"controllerFailover.etcd.members: {failover['etcd']['members']} must be 1, 3 or 5 "
                          "(an even count tolerates no more losses than the odd one below it)")
    client = _int(values, "controllerFailover.etcd.clientPort", low=1, high=65535)
    if client == _int(values, "controllerFailover.etcd.peerPort", low=1, high=65535):
        raise RenderError(f"controllerFailover.etcd.peerPort: {client} is also clientPort; give two different ports")
    for key in ("image", "storageSize", "storageClassName"):
        raw = _lookup(values, f"controllerFailover.etcd.{key}")
        if not isinstance(raw, str) or (key != "storageClassName" and not raw):
            raise RenderError(f"controllerFailover.etcd.{key}: {raw!r} must be a{' non-empty' * (key != 'storageClassName')} "
                              "string")
    parse_quantity("controllerFailover.etcd.storageSize", failover["etcd"]["storageSize"])


# ----------------------------------------------------------------------------- sizes

def shm_size_bytes(values: dict[str, Any]) -> int:
    """The size of the memory-backed /dev/shm: the memory tier's two slots per rank for every
    rank of the pod, plus what unbroken's capacity check keeps free (max(256 MiB, 10% of the
    free bytes)), plus ``memoryTier.extraBytes``; rounded up to MiB."""
    from unbroken.checkpoint.memory import MIN_HEADROOM_BYTES
    from unbroken.checkpoint.capacity import shm_slots_bytes

    extra = parse_quantity("memoryTier.extraBytes", values["memoryTier"]["extraBytes"])
    if not values["memoryTier"]["everySteps"]:
        return _round_mib(max(extra, 64 << 20))
    state = parse_quantity("memoryTier.stateBytesPerRank", values["memoryTier"]["stateBytesPerRank"])
    needed = shm_slots_bytes(state) * values["procPerNode"]
    # The check passes when needed + max(MIN, free // 10) <= free, with free = the size at start.
    size = max(needed + MIN_HEADROOM_BYTES, math.ceil(needed * 10 / 9) + 1)
    return _round_mib(size + extra)


def _round_mib(n: int) -> int:
    return -(-n // (1 << 20)) << 20


def _check_memory_limit(values: dict[str, Any]) -> None:
    limit = (values["resources"].get("limits") or {}).get("memory")
    if limit is None:
        return
    shm = shm_size_bytes(values)
    if parse_quantity("resources.limits.memory", limit) <= shm:
        raise RenderError(
            f"resources.limits.memory: {limit} leaves nothing for training: the memory-backed /dev/shm "
            f"({shm >> 20}Mi, for memoryTier) counts against the container's memory limit. Raise the limit, "
            "or lower memoryTier.stateBytesPerRank / procPerNode, or set memoryTier.everySteps=0")


# ----------------------------------------------------------------------------- derived values

def controller_host(values: dict[str, Any]) -> str:
    return f"{values['name']}-controller"


def etcd_name(values: dict[str, Any]) -> str:
    return f"{values['name']}-etcd"


def etcd_hosts(values: dict[str, Any]) -> list[str]:
    """The etcd members' DNS names (the StatefulSet's pods under its headless Service)."""
    name = etcd_name(values)
    return [f"{name}-{i}.{name}.{values['namespace']}.svc"
            for i in range(values["controllerFailover"]["etcd"]["members"])]


def shared_storage(values: dict[str, Any]) -> bool:
    """Whether every pod sees the same storage tier: a claim, or a single pod. The storage tier's
    commit needs every rank's files in one place (docs/limitations.md)."""
    return bool(values["storage"]["claimName"]) or values["nodes"] + values["standbyNodes"] == 1


def termination_grace_s(values: dict[str, Any]) -> int:
    """The pods' terminationGracePeriodSeconds: the value, else fault-scheduling's."""
    return values.get("terminationGracePeriodSeconds") or FAULT_SCHEDULING[values["faultScheduling"]]


def sigterm_dump_timeout_s(values: dict[str, Any]) -> float:
    """--sigterm-dump-timeout-s: the value, else what the grace period leaves after the stop (0: no dump)."""
    dump = values.get("sigtermDumpTimeoutSeconds")
    return dump if dump is not None else max(0, termination_grace_s(values) - STOP_AFTER_DUMP_S)


def persist_every_steps(values: dict[str, Any]) -> int:
    return values["storage"]["persistEverySteps"] if shared_storage(values) else 0
