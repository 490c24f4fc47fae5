"""A controller candidate as its own process, for the partition tests: campaign, then commit one
step after another while leading; when fenced, campaign again. Every outcome is appended to
``--out`` as one JSON line (``lead``, ``commit``, ``fenced``), flushed at once.

    python -m tests.consensus.candidate --endpoints H:P,... --prefix P --node N --out F --steps K
"""

from __future__ import annotations

import argparse
import json
import time

from unbroken.consensus.durable import DurableState, DurableStore, StepAlreadyCommitted
from unbroken.consensus.election import Election, Fenced
from unbroken.consensus.etcd import EtcdClient, EtcdError


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--ttl-s", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=0.05)
    args = parser.parse_args()
    client = EtcdClient("etcd://" + args.endpoints, timeout_s=1.0)
    store = DurableStore(client, args.prefix.encode())
    with open(args.out, "a", buffering=1) as out:
        def note(**record):
            out.write(json.dumps({"node": args.node, "t": time.time(), **record}) + "\n")

        while True:
            election = Election(client, args.prefix.encode(), node=args.node, address=f"{args.node}:0",
                                ttl_s=args.ttl_s)
            term = election.campaign(timeout_s=60)
            note(event="lead", term=term.revision)
            try:
                store.record_term(term, f"{args.node}:0")
                while True:
                    # read afresh before each commit: a leader woken from SIGSTOP then races the new
                    # leader for the next step, and only the fence (not the commit log) can stop it
                    try:
                        state = store.load() or DurableState()
                    except EtcdError:  # a member lost, no quorum for a moment: not a lost term
                        time.sleep(args.step_s)
                        continue
                    if state.committed_step + 1 >= args.steps:
                        break
                    state = store.commit(term, state.committed_step + 1, state)
                    note(event="commit", term=term.revision, step=state.committed_step)
                    time.sleep(args.step_s)
                election.resign()
                note(event="done", term=term.revision)
                return
            except (Fenced, StepAlreadyCommitted, EtcdError) as exc:  # a commit refused or unanswered
                note(event="fenced", term=term.revision, error=type(exc).__name__)
                election.resign()


if __name__ == "__main__":
    main()
