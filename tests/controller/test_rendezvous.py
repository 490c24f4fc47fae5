"""The attempt's TCPStore for plain scripts (controller/rendezvous.py): its port is known at once, torch
is imported only when a client connects (a job of managed ranks never imports it in the launcher), and a
plain client that connected before the store existed gets a working store. Real sockets, a real TCPStore,
each case in a fresh interpreter (this one has torch imported already)."""

from __future__ import annotations

import subprocess
import sys

import pytest

NO_CLIENT = """
import sys, time
from unbroken.controller.rendezvous import PlainStore
store = PlainStore("127.0.0.1")
assert store.port > 0
time.sleep(0.3)
store.close()
store.close()  # idempotent
print("torch imported:", "torch" in sys.modules)
"""

A_CLIENT = """
from datetime import timedelta
from unbroken.controller.rendezvous import PlainStore
store = PlainStore("127.0.0.1")
import torch.distributed as dist  # the client side (a plain script's init_process_group)
client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=60))
client.set("k", "v")
print("got:", client.get("k").decode())
store.close()
"""


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.timeout(150)
def test_no_client_no_torch():
    assert _run(NO_CLIENT).strip() == "torch imported: False"


@pytest.mark.timeout(150)
def test_a_plain_client_gets_a_working_store():
    assert _run(A_CLIENT).strip() == "got: v"
