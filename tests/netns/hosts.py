"""Several "hosts" on one machine: each its own network namespace with its own address.

Layout (everything lives inside namespaces; the machine's own namespace gets nothing)::

    ns <tag>-sw:  bridge br0 ── port p0 ── p1 ── ... (one veth end per host: the "switch port")
    ns <tag>-h0:  eth0 10.231.28.1/24 (the other veth end), lo
    ns <tag>-h1:  eth0 10.231.28.2/24, lo
    ...

A host's "memory" is its own directory under /dev/shm (``Host.shm_dir``, a tmpfs like /dev/shm on
a real node), handed to its agent with ``--shm-dir``: namespaces share /dev/shm, and a node's memory
tier must not be visible from another node. Faults at node level act from outside the node: every
process of a host is the set ``ip netns pids`` lists (its agent, its workers, their spares), and its
link is its switch port.

:meth:`Hosts.close` kills every process of every host, deletes the namespaces (the bridge and the
veth pairs go with them) and the hosts' memory directories, whatever state the test left them in.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.231.28"  # private, unused on this machine (its own addresses: lo and 192.0.2.0/24)
IFNAME = "eth0"  # every host's interface has this name inside its namespace (GLOO_SOCKET_IFNAME)


class NetnsUnavailable(RuntimeError):
    """``ip netns`` is not permitted here (not root, no iproute2, a sandbox without it)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    except FileNotFoundError as exc:
        raise NetnsUnavailable(f"no `ip` command (iproute2): {exc}") from None
    if check and done.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


@dataclass
class Host:
    """One host: a namespace, its address, its switch port (in the switch's namespace), its memory."""

    index: int
    ns: str
    addr: str
    port: str  # the switch-side end of its veth pair
    switch_ns: str
    shm_dir: Path
    frozen: bool = field(default=False)

    def argv(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside this host."""
        return ["ip", "netns", "exec", self.ns, *cmd]

    def env(self) -> dict[str, str]:
        """What a process on this host needs: gloo binds to this host's interface (the machine's
        hostname resolves to loopback, which every namespace has)."""
        return {"GLOO_SOCKET_IFNAME": IFNAME}

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.ns, check=False).stdout
        return [int(p) for p in out.split() if p.strip().isdigit() and int(p) != os.getpid()]

    def signal_all(self, sig: int) -> list[int]:
        """Send ``sig`` to every process of this host; the pids it reached."""
        hit = []
        for pid in self.pids():
            try:
                os.kill(pid, sig)
                hit.append(pid)
            except ProcessLookupError:
                pass
        return hit

    # -- node-level faults -------------------------------------------------------------------
    def kill(self) -> list[int]:
        """The whole node dies: SIGKILL every process, and its memory is gone with it."""
        pids = self.signal_all(signal.SIGKILL)
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        return pids

    def freeze(self) -> list[int]:
        """The node stops (SIGSTOP every process): its sockets stay open, nothing answers."""
        self.frozen = True
        return self.signal_all(signal.SIGSTOP)

    def thaw(self) -> list[int]:
        self.frozen = False
        return self.signal_all(signal.SIGCONT)

    def cut(self) -> None:
        """Unplug its cable: the switch port goes down, packets to and from it are lost."""
        _ip("-n", self.switch_ns, "link", "set", self.port, "down")

    def restore(self) -> None:
        _ip("-n", self.switch_ns, "link", "set", self.port, "up")


class Hosts:
    """N hosts on one bridge (see the module docstring). Build with :meth:`create`; always :meth:`close`."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.switch_ns = f"{tag}-sw"
        self.hosts: list[Host] = []
        self._made_ns: list[str] = []

    @classmethod
    def create(cls, n: int) -> Hosts:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (ip netns add)")
        hosts = cls(f"ub{secrets.token_hex(2)}")
        try:
            hosts._build(n)
        except BaseException:
            hosts.close()
            raise
        return hosts

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made_ns.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self, n: int) -> None:
        self._add_ns(self.switch_ns)
        _ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch_ns, "link", "set", "br0", "up")
        for i in range(n):
            ns, port, inner = f"{self.tag}-h{i}", f"{self.tag}p{i}", f"{self.tag}n{i}"
            self._add_ns(ns)
            # Made inside the switch's namespace: the machine's own namespace never holds either end.
            _ip("-n", self.switch_ns, "link", "add", port, "type", "veth", "peer", "name", inner)
            _ip("-n", self.switch_ns, "link", "set", inner, "netns", ns)
            _ip("-n", self.switch_ns, "link", "set", port, "master", "br0")
            _ip("-n", self.switch_ns, "link", "set", port, "up")
            _ip("-n", ns, "link", "set", inner, "name", IFNAME)
            addr = f"{SUBNET}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            shm = Path("/dev/shm") / f"{self.tag}-h{i}"
            shm.mkdir(mode=0o700)
            self.hosts.append(Host(i, ns, addr, port, self.switch_ns, shm))
        self._wait_reachable()

    def _wait_reachable(self, timeout_s: float = 10.0) -> None:
        """Every host reaches host 0 (addresses usable: no duplicate-address wait left)."""
        deadline = time.monotonic() + timeout_s
        for h in self.hosts[1:]:
            while True:
                probe = subprocess.run(h.argv(["python3", "-c", (
                    "import socket,sys; s=socket.socket(); s.settimeout(1)\n"
                    f"try: s.connect(('{self.hosts[0].addr}', 9))\n"
                    "except ConnectionRefusedError: sys.exit(0)\n"
                    "except OSError: sys.exit(1)")]), capture_output=True, timeout=10)
                if probe.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise NetnsUnavailable(f"host {h.ns} cannot reach {self.hosts[0].addr} over the bridge")
                time.sleep(0.1)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def close(self) -> None:
        """Kill every process of every host (stopped ones too), remove namespaces and memory dirs."""
        for _ in range(3):
            left = [p for h in self.hosts for p in h.pids()]
            if not left:
                break
            for h in self.hosts:
                h.signal_all(signal.SIGKILL)  # (SIGKILL also ends a stopped process)
            time.sleep(0.2)
        for name in reversed(self._made_ns):
            _ip("netns", "del", name, check=False)
        for h in self.hosts:
            shutil.rmtree(h.shm_dir, ignore_errors=True)
