"""One rank of an optim test: ``optim_worker.py SCENARIO RANK WORLD STORE_PORT OUT_DIR``.

Joins a gloo group over the test's TCPStore, runs the scenario, and writes its results
(tensors and plain values only) to OUT_DIR/rank{RANK}.pt for the test to check.
"""

from __future__ import annotations

import io
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from optim_model import BUCKET_BYTES, OPTIMIZERS, STEPS, batch, build_model, flat_weights, loss_fn, lr_lambda
from torch import nn

from unbroken.errors import CollectiveAborted, OptimizerError
from unbroken.optim import ShardedOptimizer

GLOO_TIMEOUT_S = 30
STORE = None  # the test's TCPStore client, set in main()


def train(model, opt, sched, rank, world, start, stop, losses=None):
    for step in range(start, stop):
        x, y = batch(step, rank)
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if losses is not None:
            losses.append(loss.detach().clone())


def make(name, num_replicas, seed=0, **extra):
    cls, kwargs = OPTIMIZERS[name]
    model = build_model(seed)
    opt = ShardedOptimizer(model, cls, num_replicas=num_replicas, bucket_bytes=BUCKET_BYTES, **extra, **kwargs)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


def state_bytes(opt) -> int:
    """Measured independently of memory_report: per-element state tensors of this rank."""
    return sum(v.nbytes for st in opt.state_dict()["state"].values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() >= 1)


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def scenario_train(rank, world, out):
    res = {}
    for name in OPTIMIZERS:
        for n in (1, 2, 4):
            phases = []
            # N=2 polls with an abort check that never fires; the others wait blocking.
            extra = {"should_abort": (lambda: False)} if n == 2 else {}
            model, opt, sched = make(name, n, on_phase=lambda p, s, log=phases: log.append((p, s)), **extra)
            losses = []
            t0 = time.perf_counter()
            train(model, opt, sched, rank, world, 0, STEPS, losses)
            print(f"{name} N={n}: {time.perf_counter() - t0:.2f} s", flush=True)
            res[f"{name}_n{n}_weights"] = flat_weights(model)
            res[f"{name}_n{n}_losses"] = torch.stack(losses)
            res[f"{name}_n{n}_state_bytes"] = state_bytes(opt)
            report = opt.memory_report()
            res[f"{name}_n{n}_report_bytes"] = report["optimizer_state_bytes"]
            res[f"{name}_n{n}_shard_numel"] = report["shard_numel"]
            res[f"{name}_n{n}_phases"] = [f"{p}:{s}" for p, s in phases]
            res[f"{name}_n{n}_lr"] = opt.param_groups[0]["lr"]
    res.update(resume_same_layout(rank, world))
    res.update(resume_other_layout(rank, world))
    res.update(abort_in_gather_then_regroup(rank, world))
    res.update(validation(rank, world))
    return res


def abort_in_gather_then_regroup(rank, world):
    """N=2: the abort order arrives after step 5's update, during its parameter gather. The
    step is refused until finished; the gather is finished on a new group that torch.distributed
    does not know (a next generation built on the store), and training continues."""
    box = {"abort": False}

    def on_phase(phase, step):
        box["abort"] = phase == "update" and step == 5

    model, opt, sched = make("adamw", 2, should_abort=lambda: box["abort"], on_phase=on_phase)
    outcome = {}
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss_fn(model, x, y).backward()
        try:
            opt.step()
        except CollectiveAborted as err:
            outcome["aborted"] = f"{step}: {err}"
            box["abort"] = False
            try:
                opt.step()
            except OptimizerError as refused:
                outcome["refused"] = str(refused)
            gen1 = dist.ProcessGroupGloo(dist.PrefixStore("gen1", STORE), rank, world,
                                         timedelta(seconds=GLOO_TIMEOUT_S))
            opt.set_process_group(gen1)
            outcome["step_count_before_finish"] = opt.step_count
            opt.finish_step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return {"regroup_weights": flat_weights(model), "regroup_step_count": opt.step_count,
            **{f"regroup_{k}": v for k, v in outcome.items()}}


def resume_same_layout(rank, world):
    """N=2: 10 steps, shard state dict through torch.save/load, a new optimizer, 10 more."""
    model, opt, sched = make("adamw", 2)
    train(model, opt, sched, rank, world, 0, 10)
    sd, sched_sd, weights = roundtrip(opt.state_dict()), sched.state_dict(), model.state_dict()
    model2, opt2, sched2 = make("adamw", 2)
    model2.load_state_dict(weights)
    sched2.load_state_dict(sched_sd)
    opt2.load_state_dict(sd)
    train(model2, opt2, sched2, rank, world, 10, STEPS)
    meta = sd["sharding"]
    return {"resume_same_weights": flat_weights(model2), "resume_same_meta": [
        meta["world_size"], meta["num_replicas"], meta["shard_index"], *meta["shard_range"], meta["step_count"]]}


def resume_other_layout(rank, world):
    """N=4 for 10 steps, full state dict, then N=1 for 10 more; also loads into plain AdamW."""
    model, opt, sched = make("adamw", 4)
    train(model, opt, sched, rank, world, 0, 10)
    full = roundtrip(opt.full_state_dict())
    plain = torch.optim.AdamW(build_model().parameters(), **OPTIMIZERS["adamw"][1])
    plain.load_state_dict(full)
    shapes_ok = all(plain.state[p]["exp_avg"].shape == p.shape for g in plain.param_groups for p in g["params"])
    model2, opt2, sched2 = make("adamw", 1)
    model2.load_state_dict(model.state_dict())
    sched2.load_state_dict(sched.state_dict())
    opt2.load_full_state_dict(full)
    train(model2, opt2, sched2, rank, world, 10, STEPS)
    return {"resume_other_weights": flat_weights(model2), "full_plain_loads": shapes_ok,
            "full_step_count": full["unbroken"]["step_count"], "full_keys": sorted(full["state"])}


def validation(rank, world):
    errors = {}
    for n in (3, 8, 0):
        try:
            make("adamw", n)
            errors[f"replicas_{n}"] = "no error"
        except OptimizerError as err:
            errors[f"replicas_{n}"] = str(err)
    try:
        model, opt, sched = make("adamw", 2, seed=rank)  # different initial weights on every rank
        train(model, opt, sched, rank, world, 0, 1)  # checked at the first step (collective)
        errors["not_identical"] = "no error"
    except OptimizerError as err:
        errors["not_identical"] = str(err)
    model, opt, sched = make("adamw", 2)
    train(model, opt, sched, rank, world, 0, 1)
    model.extra = nn.Parameter(torch.zeros(3))  # a parameter added after construction
    try:
        train(model, opt, sched, rank, world, 1, 2)
        errors["added_param"] = "no error"
    except OptimizerError as err:
        errors["added_param"] = str(err)
    del model.extra  # the parameters are the constructed ones again: training goes on
    train(model, opt, sched, rank, world, 1, 3)
    return {"errors": errors, "train_after_errors": opt.step_count == 3}


def scenario_abort(rank, world, out):
    """Two normal steps, then rank `world-1` stalls and is SIGKILLed by the test before it
    reaches the gradient sync; the others must leave step() on the abort flag."""
    flag = out / "abort.flag"
    model, opt, sched = make("adamw", 2, should_abort=flag.exists)
    train(model, opt, sched, rank, world, 0, 2)
    x, y = batch(2, rank)
    loss_fn(model, x, y).backward()
    if rank == world - 1:
        (out / "victim.ready").touch()
        time.sleep(600)  # killed by the test
    before = flat_weights(model)
    (out / f"sync.{rank}").touch()
    started = time.time()
    try:
        opt.step()
        return {"outcome": "completed"}
    except CollectiveAborted as err:
        return {"outcome": "aborted", "raised_at": time.time(), "started_at": started, "message": str(err),
                "abandoned": len(opt.abandoned_work), "step_count": opt.step_count,
                "weights_unchanged": torch.equal(before, flat_weights(model))}
    except Exception as err:  # noqa: BLE001 - reported to the test as a wrong outcome
        return {"outcome": f"{type(err).__name__}: {err}"}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[5])
    rank, world, port = (int(a) for a in sys.argv[2:5])
    torch.set_num_threads(1)  # the thread count changes float results (FACTS.md)
    global STORE
    STORE = store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("optim", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    print(f"joined at {time.time():.3f}", flush=True)
    try:
        result = {"scenario_train": scenario_train, "scenario_abort": scenario_abort}[f"scenario_{scenario}"](
            rank, world, out)
        tmp = out / f"rank{rank}.pt.tmp"
        torch.save(result, tmp)
        os.replace(tmp, out / f"rank{rank}.pt")
        print(f"saved at {time.time():.3f}", flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    # Leave without tearing the group down: an aborted op may still be pending (FACTS.md).
    os._exit(0)


if __name__ == "__main__":
    main()
