"""Nothing else on the host breaks a job's recovery (issue 11, items 1 and 4).

- A local process without the job secret can neither read nor write the job's rendezvous
  during a kill: listing the TCPStore shows no key of the job (managed workers rendezvous on
  the store served over the authenticated control plane), writing guessed, old-style
  (``gen1//0/1``, ``gen0/...``) or listed keys changes nothing, and the controller refuses it
  a store connection.
- Every socket the job listens on is on the job's address (127.0.0.1 here), none on every
  interface.
- A folder named `unbroken` in the launch directory does not shadow the installed package:
  the warm spare that replaces a killed rank imports the real one.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from tests.conftest import EXAMPLE, ours
from tests.integration.helpers import TRAIN_ARGS, assert_same_weights, events, train
from unbroken.controller import rendezvous
from unbroken.errors import AuthError, ConnectionClosed, ProtocolError
from unbroken.protocol.wire import connect

STEPS = 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of a fault-free 2-rank run."""
    clean, out, _ = train(tmp_path_factory.mktemp("reference"), "reference", steps=STEPS, nproc=2)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    return out


def _unbroken_command() -> list[str]:
    """`unbroken` as a user runs it: the console script next to this interpreter (its own folder
    first on sys.path, not the working directory)."""
    script = Path(sys.executable).parent / "unbroken"
    return [str(script)] if script.exists() else [sys.executable, "-P", "-m", "unbroken.cli.main"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_kill_is_recovered_when_launched_from_a_folder_holding_an_unbroken_folder(tmp_path, reference):
    launch_dir = tmp_path / "checkout"
    (launch_dir / "unbroken").mkdir(parents=True)  # e.g. a source checkout: a namespace package here
    (launch_dir / "unbroken" / "README").write_text("not the package\n")
    out, run_dir = tmp_path / "killed.safetensors", tmp_path / "run-killed"
    cmd = [*_unbroken_command(), "run", "--nproc-per-node", "2", "--run-dir", str(run_dir),
           "--inject", "kill:rank=1:step=5", str(EXAMPLE), "--steps", str(STEPS), "--out", str(out), *TRAIN_ARGS]
    proc = subprocess.Popen(cmd, cwd=launch_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "has no attribute" not in stdout
    assert_same_weights(reference, out)
    assert [d["rung"] for d in events(run_dir, "decision")] == ["recover-in-place"]
    assert len(events(run_dir, "attempt_started")) == 1, "the job was restarted"


def _guessed_keys() -> list[str]:
    """What a process without the secret can aim at: the keys of a store without a prefix
    (gloo's under ``gen<g>/``), and random guesses of a prefix."""
    keys = []
    for gen in range(6):
        keys += [f"gen{gen}/", f"gen{gen}//0/0", f"gen{gen}//0/1", f"gen{gen}//1/0", f"gen{gen}//1/1",
                 f"gen{gen}/0", f"gen{gen}/1", f"gen{gen}/rank_0", f"gen{gen}/rank_1"]
    keys += [f"{rendezvous.new_prefix()}/gen1//0/1" for _ in range(8)]
    return keys


def _aimed_keys(seen: set[str]) -> list[str]:
    """Keys aimed at what a client learned by listing the store: each key seen, and the next
    generations' keys under each prefix seen."""
    prefixes = {key.split("/", 1)[0] for key in seen if key.startswith("rdzv-")}
    return sorted(seen) + [f"{p}//gen{g}//{a}/{b}" for p in prefixes for g in range(1, 4)
                           for a in range(2) for b in range(2)]


class ForeignClient:
    """A local process without the job secret, run as a thread during a job: each attempt's
    TCPStore (the port is in the event log, as `ss` would show it) is listed and overwritten
    with guessed keys and every key it lists; the controller's port is asked for a store
    connection with a guessed secret."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.stop = threading.Event()
        self.writes = 0
        self.seen: set[str] = set()
        self.refused: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ForeignClient:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self.stop.is_set():
            records = events(self.run_dir) if (self.run_dir / "events.jsonl").exists() else []
            for port in {e["store_port"] for e in records if e["event"] == "attempt_started"}:
                self._attack_tcpstore(port)
            for address in {e["address"] for e in records if e["event"] == "controller_started"}:
                self._ask_controller(address)
            time.sleep(0.02)

    def _attack_tcpstore(self, port: int) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
            self.seen.update(client.list_keys())
            for key in _guessed_keys() + _aimed_keys(self.seen):
                client.set(key, secrets.token_bytes(64))
            self.writes += 1
        except (RuntimeError, OSError):
            pass  # that attempt's store is gone

    def _ask_controller(self, address: str) -> None:
        if len(self.refused) >= 3:
            return
        host, _, port = address.rpartition(":")
        try:
            conn = connect(host, int(port), secrets.token_hex(32).encode(), "store", {"attempt": 0}, timeout_s=2)
        except (AuthError, ProtocolError, ConnectionClosed) as exc:
            self.refused.append(str(exc))
            return
        conn.close()
        raise AssertionError("the controller served a store connection to a client without the secret")


@contextmanager
def _sampling(sample: Callable[[], None], every_s: float = 0.1) -> Iterator[None]:
    """Call ``sample`` every ``every_s`` in a thread while the block runs."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            sample()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def _job_prefixes(run_dir: Path) -> set[str]:
    """The rendezvous prefixes the job's workers hold (their environment: the test's user can read it)."""
    found = set()
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("UNBROKEN_RUN_DIR") == str(run_dir) and env.get("UNBROKEN_STORE_PREFIX"):
            found.add(env["UNBROKEN_STORE_PREFIX"])
    return found


@pytest.mark.slow  # default run: tests/controller/test_store_service.py (the secret, the bounds), the socket test below
@pytest.mark.timeout(240)
def test_a_local_client_without_the_secret_can_neither_read_nor_write_the_rendezvous_during_a_kill(
        tmp_path, reference):
    run_dir = tmp_path / "run-attacked"
    prefixes: set[str] = set()
    with ForeignClient(run_dir) as attacker, _sampling(lambda: prefixes.update(_job_prefixes(run_dir))):
        result, out, _ = train(tmp_path, "attacked", steps=STEPS, nproc=2, timeout_s=180,
                               # --no-fork-ranks: the prefix is read from each rank's /proc environ, which a
                               # rank forked from the zygote does not update (agent/zygote.py)
                               flags=["--inject", "kill:rank=1:step=5", "--no-fork-ranks"],
                               train_args=["--step-sleep-s", "0.05"])
    assert attacker.writes > 0, "the foreign client never reached the TCPStore"
    assert attacker.refused and all("wrong job secret" in why for why in attacker.refused), attacker.refused
    assert prefixes, "the test never saw the job's prefix"
    learned = {key for key in attacker.seen if any(p in key for p in prefixes)}
    assert not learned, f"a client without the secret listed the job's rendezvous keys: {sorted(learned)[:4]}"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_weights(reference, out)
    assert [d["rung"] for d in events(run_dir, "decision")] == ["recover-in-place"]
    assert len(events(run_dir, "attempt_started")) == 1, "the job was restarted"


def _listening(run_dir: Path) -> set[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket a process of the job listens on."""
    found = set()
    for proc in psutil.process_iter():
        if not ours(proc, str(run_dir)):
            continue
        try:
            conns = proc.net_connections(kind="tcp")
        except (psutil.Error, OSError):
            continue
        found |= {(c.laddr.ip, c.laddr.port, proc.name()) for c in conns if c.status == psutil.CONN_LISTEN}
    return found


@pytest.mark.timeout(240)
def test_every_socket_a_job_listens_on_is_on_the_jobs_address(tmp_path):
    run_dir, seen = tmp_path / "run-sockets", set()
    with _sampling(lambda: seen.update(_listening(run_dir))):
        result, _, _ = train(tmp_path, "sockets", steps=6, nproc=2, timeout_s=180, train_args=["--step-sleep-s", "0.3"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    store_ports = {e["store_port"] for e in events(run_dir, "attempt_started")}
    controller_ports = {int(e["address"].rpartition(":")[2]) for e in events(run_dir, "controller_started")}
    ports = {port for _, port, _ in seen}
    assert store_ports <= ports and controller_ports <= ports, (seen, store_ports, controller_ports)
    wildcard = {s for s in seen if s[0] in ("0.0.0.0", "::", "")}
    assert not wildcard, f"the job listens on every interface: {sorted(wildcard)}"
    ours = {(ip, port) for ip, port, _ in seen if port in store_ports | controller_ports}
    assert {ip for ip, _ in ours} == {"127.0.0.1"}, sorted(seen)  # the job's address (--master-addr)
    # gloo's data sockets: the address torch resolves for the host (127.0.0.1 on most test machines)
    assert {ip for ip, _, _ in seen} <= {"127.0.0.1", socket.gethostbyname(socket.gethostname())}, sorted(seen)
