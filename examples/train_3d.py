"""Train the tiny GPT of train_gpt.py split into pipeline stages, tensor parallel, data parallel.

The seeds' layout in miniature: the model cut into ``--pp`` stages (torch.distributed.pipelining,
GPipe or 1F1B over micro-batches), each stage's blocks sharded over ``--tp`` ranks (DTensor
``parallelize_module``: attention by whole heads, the MLP by hidden feature), each (stage, tp shard)
replicated ``--dp`` times, gradients all-reduced across the replicas. What unbroken adds:
``unbroken.init()``, ``job.mesh(...)`` (the mesh whose groups survive a recovery),
``mesh.pipeline(schedule)``, ``job.track(...)``, ``job.steps(...)`` and ``with job.step():``.

    unbroken run --nproc-per-node 4 examples/train_3d.py --pp 2 --dp 2 --out w.safetensors
    unbroken run --nproc-per-node 4 --inject kill:rank=2:step=5 examples/train_3d.py --pp 2 --dp 2 --out w.safetensors
                                      # rank 2 (stage 1, replica 0) is replaced in flight, same bits
    unbroken run --nproc-per-node 4 examples/train_3d.py --pp 1 --dp 2 --tp 2 --out w.safetensors
    unbroken run --nproc-per-node 8 examples/train_3d.py --pp 2 --dp 2 --tp 2 --out w.safetensors
    torchrun --nproc-per-node 4 examples/train_3d.py --pp 2 --dp 2   # job-level restarts only

Ranks sit on the mesh ("pp", pp) x ("dp", dp) x ("tp", tp), last dimension fastest: with
pp = dp = 2, tp = 1, ranks 0 and 1 run stage 0, ranks 2 and 3 stage 1; ranks 0 and 2 are replica
0. A lost rank's stage and tp shard (parameters, optimizer and scheduler state) comes from the
rank with its pp and tp coordinates in another dp slice. Each rank writes its stage's final
weights (its local tp shards) to ``<out stem>.rank<R><suffix>``.

Determinism as in train_gpt.py: the same seed gives the same initial weights (the whole GPT is
built on every rank, then cut), the batch of (step, replica) is a pure function of them, the
reductions run in a fixed order, and the thread count is pinned. The embedding and the output
projection, one tensor in train_gpt.py, live on different stages here and are trained apart
(Megatron keeps them equal with an extra all-reduce between the first and last stage).
"""

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import unbroken
from train_gpt import GPT, CausalSelfAttention, GPTConfig, get_batch, load_data, lr_multiplier, parse_args

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class SplitAttention(nn.Module):
    """train_gpt.py's causal self-attention with its fused q/k/v projection cut into three Linears
    (the same weights), so that tensor parallelism can shard each by output feature: a rank then
    holds whole heads of q, k and v (n_head / tp of them) and attends over them alone; the output
    projection, sharded by input feature, sums the heads' contributions across the tp group."""

    def __init__(self, attn: CausalSelfAttention) -> None:
        super().__init__()
        n_embd = attn.c_proj.weight.size(0)
        self.head_size = n_embd // attn.n_head
        self.dropout = attn.dropout
        self.q, self.k, self.v = (nn.Linear(n_embd, n_embd, bias=False) for _ in range(3))
        with torch.no_grad():
            for linear, w in zip((self.q, self.k, self.v), attn.c_attn.weight.split(n_embd, dim=0)):
                linear.weight.copy_(w)
        self.c_proj, self.resid_dropout = attn.c_proj, attn.resid_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, local heads * head_size) under TP
        heads = q.size(-1) // self.head_size  # this rank's heads: n_head / tp
        q, k, v = (t.view(B, T, heads, self.head_size).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, heads * self.head_size)
        return self.resid_dropout(self.c_proj(y))  # Rowwise under TP: all-reduced over tp


# Megatron's split of a block: q/k/v and the MLP's first Linear by output feature (Colwise), the two
# output projections by input feature (Rowwise, their outputs all-reduced over the tp group).
TP_PLAN = {"attn.q": ColwiseParallel, "attn.k": ColwiseParallel, "attn.v": ColwiseParallel,
           "attn.c_proj": RowwiseParallel, "mlp.c_fc": ColwiseParallel, "mlp.c_proj": RowwiseParallel}


def parallelize_blocks(stage: "Stage", tp_mesh) -> None:
    """Shard the stage's blocks over the mesh's tp sub-mesh (DTensor parameters, local shards).
    ``src_data_rank=None``: every rank built the same weights from the seed and keeps its own
    slice, no scatter from a source rank (a replacement builds its stage while its groups are held)."""
    for block in stage.h:
        parallelize_module(block, tp_mesh, {name: style() for name, style in TP_PLAN.items()}, src_data_rank=None)


class Stage(nn.Module):
    """Stage ``index`` of ``num_stages`` of a GPT: the first embeds tokens, the last projects to
    logits; each runs its share of the transformer blocks. Built from a whole GPT (its weights)."""

    def __init__(self, gpt: GPT, index: int, num_stages: int) -> None:
        super().__init__()
        blocks = list(gpt.transformer.h)
        per, extra = divmod(len(blocks), num_stages)
        start = index * per + min(index, extra)
        self.first, self.last = index == 0, index == num_stages - 1
        self.h = nn.ModuleList(blocks[start:start + per + (index < extra)])
        for block in self.h:  # q, k and v apart: tensor parallelism splits them by whole heads
            block.attn = SplitAttention(block.attn)
        if self.first:
            self.wte, self.wpe, self.drop = gpt.transformer.wte, gpt.transformer.wpe, gpt.transformer.drop
        if self.last:
            self.ln_f, self.lm_head = gpt.transformer.ln_f, gpt.lm_head
            if not self.first:  # its own copy of the tied weight: the embedding lives on stage 0
                self.lm_head.weight = nn.Parameter(gpt.lm_head.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # token ids (B, T) -> hidden states (B, T, C)
            pos = torch.arange(x.size(1), device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last stage's loss of one micro-batch (the schedule averages over micro-batches)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_schedule(stage_mod: Stage, mesh: "unbroken.parallel.mesh.JobMesh", cfg: GPTConfig,
                   args: argparse.Namespace, device: torch.device):
    """The stage's PipelineStage with its micro-batch shapes given (no shape exchange at the first
    step: nothing to pickle, nothing a replacement would have to replay) and its schedule."""
    micro = args.batch_size // args.microbatches
    # requires_grad: the shapes' metadata says a gradient flows back through the hidden states
    hidden = torch.zeros(micro, cfg.block_size, cfg.n_embd, device=device, requires_grad=True)
    tokens = torch.zeros(micro, cfg.block_size, dtype=torch.long, device=device)
    logits = torch.zeros(micro, cfg.block_size, cfg.vocab_size, device=device)
    stage = PipelineStage(stage_mod, mesh.coord("pp"), mesh.size("pp"), device,
                          input_args=tokens if stage_mod.first else hidden,
                          output_args=logits if stage_mod.last else hidden, group=mesh.group("pp"))
    schedule = SCHEDULES[args.schedule](stage, n_microbatches=args.microbatches, loss_fn=lm_loss)
    return mesh.pipeline(schedule)  # warmed up again at the redo after an in-flight recovery


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel (DTensor) tensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def all_reduce_gradients(params: list[nn.Parameter], group: dist.ProcessGroup, dp: int) -> None:
    """Average the stage's gradients over its replicas: one flat buffer of this rank's (tp) shards,
    one all-reduce on the mesh's dp group (a group unbroken can abandon on a fault), the same order
    every step. The replicas of a shard have the same tp coordinate: the shapes match."""
    grads = [local(p.grad) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(dp)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """train_gpt.py's flags (its --optimizer is ignored: AdamW per stage), plus the layout."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (>= 1)")
    p.add_argument("--dp", type=int, default=2, help="replicas of each stage (>= 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel shards of each block (>= 1; divides "
                   "--n-head)")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step; divides --batch-size")
    own, rest = p.parse_known_args(argv)
    args = parse_args(rest)
    if own.pp < 1 or own.dp < 1 or own.tp < 1:
        p.error(f"--pp, --dp and --tp must be >= 1, got --pp {own.pp} --dp {own.dp} --tp {own.tp}")
    if args.n_head % own.tp:
        p.error(f"--tp {own.tp} must divide --n-head {args.n_head} (each rank holds whole heads)")
    if own.microbatches < 1 or args.batch_size % own.microbatches:
        p.error(f"--microbatches {own.microbatches} must be >= 1 and divide --batch-size {args.batch_size}")
    if args.n_layer < own.pp:
        p.error(f"--n-layer {args.n_layer} must be >= --pp {own.pp} (every stage runs a block)")
    vars(args).update(vars(own))
    return args


def save_stage(stage_mod: nn.Module, out: str, rank: int) -> str:
    """This rank's stage weights, to ``<out stem>.rank<R><suffix>``, written then renamed into place."""
    stem, suffix = os.path.splitext(out)
    path = f"{stem}.rank{rank}{suffix}"
    save_file({k: local(v).detach().contiguous().clone() for k, v in stage_mod.state_dict().items()}, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)
    return path


def main(argv: list[str] | None = None, on_stage: Callable[[Stage, "unbroken.Job"], None] | None = None) -> None:
    """``on_stage(stage, job)``: called once the stage is built (tests arm faults with it)."""
    args = parse(argv)
    torch.set_num_threads(args.num_threads)  # part of the run's identity: it changes float results
    job = unbroken.init()
    if job.world_size != args.pp * args.dp * args.tp:
        job.close()
        raise SystemExit(f"train_3d.py: --pp {args.pp} x --dp {args.dp} x --tp {args.tp} needs "
                         f"{args.pp * args.dp * args.tp} ranks, the job has {job.world_size}")
    mesh = job.mesh(("pp", args.pp), ("dp", args.dp), ("tp", args.tp))
    data, vocab = load_data()
    cfg = GPTConfig(vocab_size=len(vocab), block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    torch.manual_seed(args.seed)  # same seed everywhere: the whole GPT, then this rank's stage of it
    stage_mod = Stage(GPT(cfg), mesh.coord("pp"), args.pp).to(job.device)
    if args.tp > 1:
        parallelize_blocks(stage_mod, mesh.device_mesh["tp"])
    schedule = build_schedule(stage_mod, mesh, cfg, args, job.device)
    params = [p for p in stage_mod.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    warmup_steps = min(args.warmup_steps, args.steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_multiplier(step, warmup_steps=warmup_steps, total_steps=args.steps))
    job.track(model=stage_mod, optimizer=opt, scheduler=sched)
    if on_stage is not None:
        on_stage(stage_mod, job)
    replica = mesh.coord("dp")
    t0 = time.perf_counter()
    for step in job.steps(args.steps):
        with job.step():  # the fault boundary: a failure anywhere in the pipeline redoes this step
            x, y = get_batch(data, step, replica, seed=args.seed, batch_size=args.batch_size,
                             block_size=args.block_size)  # the same batch on every stage of a replica
            losses: list[torch.Tensor] = []
            if stage_mod.first and stage_mod.last:
                schedule.step(x.to(job.device), target=y.to(job.device), losses=losses)
            elif stage_mod.first:
                schedule.step(x.to(job.device))
            else:
                schedule.step(target=y.to(job.device) if stage_mod.last else None, losses=losses)
            if args.dp > 1:
                all_reduce_gradients(params, mesh.group("dp"), args.dp)
            opt.step()  # a tracked optimizer's step enters 'update': the step commits first
            opt.zero_grad(set_to_none=True)
            sched.step()
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            t1 = time.perf_counter()
            if losses:
                loss = torch.stack(losses).mean().item()
                job.report(loss=loss)
                if replica == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                    print(f"step {step}: loss {loss:.4f} (rank {job.rank}, last stage), "
                          f"{(t1 - t0) * 1000:.1f} ms", flush=True)
            elif job.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                print(f"step {step}: {(t1 - t0) * 1000:.1f} ms", flush=True)
            t0 = t1
    if args.out:
        save_stage(stage_mod, args.out, job.rank)
    job.close()


if __name__ == "__main__":
    main()
