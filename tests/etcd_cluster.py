"""A real etcd cluster (1 or 3 members) on loopback for tests: free ports, data under tmp.

:func:`etcd_binary` finds etcd (``scripts/quickstart.sh test`` installs Debian's ``etcd-server``
where it is missing); a test without it is skipped with that reason. :class:`EtcdCluster` starts
the members, waits until the cluster answers, and kills every member on :meth:`close` (the
fixtures call it in a ``finally``, so even a failed test leaves no etcd behind).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

INSTALL_HINT = "etcd is not installed: `bash scripts/quickstart.sh test` installs it (apt-get install etcd-server)"


def etcd_binary() -> str:
    found = shutil.which("etcd") or (Path("/usr/bin/etcd").is_file() and "/usr/bin/etcd")
    if not found:
        pytest.skip(INSTALL_HINT)
    return str(found)


class EtcdCluster:
    """``size`` etcd members on 127.0.0.1, each a child process of the test (see module docstring)."""

    def __init__(self, root: Path, size: int, *, start_timeout_s: float = 20.0) -> None:
        self.binary = etcd_binary()
        self.root = root
        self.names = [f"m{i}" for i in range(size)]
        self.client_ports = {n: free_port() for n in self.names}
        self.peer_ports = {n: free_port() for n in self.names}
        self.procs: dict[str, subprocess.Popen] = {}
        self.initial = ",".join(f"{n}=http://127.0.0.1:{self.peer_ports[n]}" for n in self.names)
        try:
            for name in self.names:
                self.start_member(name, state="new")
            self.wait_healthy(start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", self.client_ports[n]) for n in self.names]

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def start_member(self, name: str, state: str = "existing") -> None:
        client = f"http://127.0.0.1:{self.client_ports[name]}"
        peer = f"http://127.0.0.1:{self.peer_ports[name]}"
        log = open(self.root / f"etcd-{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [self.binary, "--name", name, "--data-dir", str(self.root / f"etcd-{name}"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", self.initial, "--initial-cluster-state", state,
             "--initial-cluster-token", f"unbroken-test-{self.peer_ports[self.names[0]]}",
             # fast elections on loopback (defaults 100 ms / 1000 ms)
             "--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def kill_member(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(10)

    def leader_member(self) -> str:
        """The name of the member that leads the etcd cluster now (asked of each running member)."""
        from unbroken.consensus.etcd import EtcdClient

        ids, leader = {}, ""
        for name in self.procs:
            status = EtcdClient([("127.0.0.1", self.client_ports[name])], timeout_s=2.0).status()
            ids[status["header"]["member_id"]] = name
            leader = status.get("leader", leader)
        return ids[leader]

    def wait_healthy(self, timeout_s: float) -> None:
        from unbroken.consensus.etcd import EtcdClient, EtcdError

        deadline = time.monotonic() + timeout_s
        for host, port in [("127.0.0.1", self.client_ports[n]) for n in self.procs]:
            client = EtcdClient([(host, port)], timeout_s=1.0)
            while True:
                try:
                    client.range(b"/health-probe")  # linearizable: needs a quorum and a leader
                    break
                except EtcdError as exc:
                    if time.monotonic() >= deadline:
                        raise AssertionError(f"etcd member {host}:{port} not healthy in {timeout_s} s: {exc}\n"
                                             + self.logs()) from None
                    time.sleep(0.05)

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(self.root.glob("etcd-*.log")))

    def close(self) -> None:
        for name in list(self.procs):
            proc = self.procs.pop(name)
            proc.kill()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
