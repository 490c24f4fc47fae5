"""Train a tiny character-level GPT, data-parallel, through failures, with unbroken.

nanoGPT in miniature: the model, the data and the training loop in one file. What unbroken
adds is five lines: `unbroken.init()`, `job.track(...)`, `job.steps(...)`, `with job.step():`
and `job.report(...)`. Everything else is plain PyTorch.

    python examples/train_gpt.py --steps 20 --optimizer plain         # one process
    torchrun --nproc-per-node 4 examples/train_gpt.py                 # job-level restarts only
    unbroken run --nproc-per-node 4 --inject kill:rank=2:step=30 examples/train_gpt.py --out w.safetensors
                                                                      # through faults, same bits

Determinism is the point of this example: the same --seed and world size give bit-identical
final weights, with or without faults along the way, because
  * every rank builds the same initial weights from --seed,
  * the batch of (step, rank) is a pure function of (seed, step, rank): the data position
    *is* the step counter, which unbroken restores,
  * gradients are averaged with the same collective in the same order every step,
  * the intra-op thread count is pinned (--num-threads), since it changes float results.
"""

import argparse
import hashlib
import math
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

import unbroken

# -----------------------------------------------------------------------------------------
# Data: a deterministic synthetic corpus, generated in code (no file to ship or download).
# A small grammar of English-like sentences: enough structure (words, spaces, capitals,
# punctuation, paragraphs) that a character-level model's loss visibly falls in a few dozen
# steps, and the same text on every machine and Python version.

_ADJECTIVES = ("old", "young", "quiet", "brave", "tired", "clever", "small", "great",
               "silver", "dark", "gentle", "restless", "honest", "curious", "golden")
_NOUNS = ("king", "miller", "river", "fox", "sailor", "garden", "lantern", "horse", "widow",
          "bridge", "scholar", "storm", "tower", "child", "ship", "forest", "letter", "bell")
_VERBS = ("watched", "followed", "found", "forgot", "carried", "praised", "feared", "crossed",
          "answered", "remembered", "mended", "visited", "lost", "guarded", "called")
_PLACES = ("by the sea", "in the valley", "under the hill", "at the old mill", "near the gate",
           "before the winter", "after the rain", "in the town", "beyond the wall")
_NAMES = ("Anna", "Thomas", "Margaret", "Edmund", "Clara", "Hugh", "Eleanor", "Jasper")
_CORPUS_SEED = 0  # fixed: the corpus is part of the example, not of the run's --seed


def _sentence(rng: random.Random) -> str:
    adjective, noun, verb, other, place = (rng.choice(words) for words in
                                           (_ADJECTIVES, _NOUNS, _VERBS, _NOUNS, _PLACES))
    form = rng.randrange(5)
    if form == 0:
        return f"the {adjective} {noun} {verb} the {other} {place}."
    if form == 1:
        return f"{rng.choice(_NAMES)} {verb} the {adjective} {noun}, and the {other} was {rng.choice(_ADJECTIVES)}."
    if form == 2:
        return f"{place}, a {noun} {verb} the {adjective} {other}."
    if form == 3:
        return f"\"{rng.choice(_NAMES)}, the {noun} is {adjective},\" said {rng.choice(_NAMES)}."
    return f"no one {verb} the {noun} {place}, for it was {adjective}."


def make_corpus(num_chars: int = 40_000) -> str:
    """About `num_chars` characters of paragraphs; always the same text."""
    rng = random.Random(_CORPUS_SEED)  # random.Random(int).choice/randrange are stable across versions
    paragraphs: list[str] = []
    length = 0
    while length < num_chars:
        sentences = (_sentence(rng) for _ in range(rng.randint(3, 7)))
        paragraph = " ".join(s[0].upper() + s[1:] for s in sentences)
        paragraphs.append(paragraph)
        length += len(paragraph) + 2
    return "\n\n".join(paragraphs) + "\n"


def load_data() -> tuple[torch.Tensor, list[str]]:
    """The corpus as a 1-D tensor of token ids, and the vocabulary (one token per character)."""
    text = make_corpus()
    vocab = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(vocab)}
    return torch.tensor([stoi[ch] for ch in text], dtype=torch.long), vocab


def batch_seed(seed: int, step: int, rank: int) -> int:
    """A 64-bit generator seed that is a pure function of (seed, step, rank).

    Hashing avoids the collisions of arithmetic mixes (seed*K + step ...) for any values.
    """
    digest = hashlib.blake2b(f"{seed}/{step}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def get_batch(data: torch.Tensor, step: int, rank: int, *, seed: int, batch_size: int,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch for step `step`: inputs x and next-character targets y, (B, T) each.

    Sampled with a private generator, so it neither reads nor advances the global RNG: a
    step redone after a recovery sees exactly the batch it saw the first time.
    """
    generator = torch.Generator().manual_seed(batch_seed(seed, step, rank))
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[i : i + block_size] for i in starts.tolist()])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in starts.tolist()])  # shifted by one
    return x, y


# -----------------------------------------------------------------------------------------
# Model: nanoGPT's GPT, without bias terms, with weight tying.

@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 32   # context length in characters
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0   # >0 draws from the global RNG, which unbroken restores too

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size): heads become a batch dimension
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,  # a token sees only its past
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # pre-norm residual blocks, as in GPT-2
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),  # token embeddings
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),  # position embeddings
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=False),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying: the input embedding and the output projection are one tensor.
        # model.parameters() yields it once, so the optimizer and the all-reduce see it once.
        self.transformer.wte.weight = self.lm_head.weight
        # GPT-2 init; the layers are created and initialized in a fixed order, so the same
        # global seed gives the same weights on every rank.
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # scale down residual projections by depth
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.size(1)
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


# -----------------------------------------------------------------------------------------
# Training pieces

def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> float:
    """nanoGPT's schedule as a factor of --lr: linear warmup, then cosine decay to min_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))


def all_reduce_gradients(params: list[nn.Parameter], job: "unbroken.Job") -> None:
    """Average gradients over all ranks (the `--optimizer plain` path; DDP does this for you).

    One flat buffer and one collective instead of one per tensor: far fewer round trips.
    The sum runs in the same order every step, so the result is reproducible bit for bit.
    """
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    job.all_reduce(flat)        # sum over ranks (gloo has no AVG); unbroken can abandon it on a fault
    flat.div_(job.data_world_size)  # the micro-batches of the global batch (the world size, unless the job shrank)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sum_gradients_in_data_rank_order(params: list[nn.Parameter], parts: dict[int, torch.Tensor],
                                     job: "unbroken.Job") -> None:
    """Average the per-micro-batch gradients ``parts`` (flat, by data rank) over the job, added in data-rank
    order (`--exact-reduce`): the same bits at any world size, so a job that lost a node and went on
    smaller (rung elastic) ends bit-equal to the fault-free run. An all-gather instead of an all-reduce."""
    flat = job.sum_over_data_ranks(parts)
    flat.div_(job.data_world_size)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def resolve_num_replicas(requested: int, world_size: int) -> int:
    """How many ranks hold each optimizer shard; raises ValueError if it cannot divide the world."""
    if world_size == 1:
        return 1  # one process: nothing to replicate across
    if world_size % requested:
        raise ValueError(f"--num-replicas {requested} does not divide the world size {world_size}; "
                         "pick a divisor of the number of ranks")
    return requested


def build_optimizer(model: nn.Module, args: argparse.Namespace, num_replicas: int,
                    job: "unbroken.Job | None" = None) -> torch.optim.Optimizer:
    # As nanoGPT: weight decay on matrices (weights, embeddings) only, not on LayerNorm gains.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    hyper = dict(lr=args.lr, betas=(0.9, 0.95))
    if args.optimizer == "plain":
        return torch.optim.AdamW(groups, **hyper)
    # ZeRO-1: optimizer state sharded over the ranks, each shard held by num_replicas ranks
    # so that a lost rank's shard survives on a peer. It averages gradients inside step().
    # It syncs over the job's process group, which changes after an in-flight recovery.
    return unbroken.optim.ShardedOptimizer(groups, optimizer_class=torch.optim.AdamW, num_replicas=num_replicas,
                                           process_group=job.process_group if job else None, **hyper)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="optimizer steps in total")
    p.add_argument("--seed", type=int, default=1337, help="initial weights and batches")
    p.add_argument("--optimizer", choices=("sharded", "plain"), default="sharded",
                   help="sharded: unbroken.optim.ShardedOptimizer (ZeRO-1 with replicas); "
                        "plain: AdamW on every rank after an explicit gradient all-reduce")
    p.add_argument("--num-replicas", type=_positive_int, default=2,
                   help="ranks holding each optimizer shard (sharded only; 1 with one process)")
    p.add_argument("--lr", type=_non_negative_float, default=3e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=_non_negative_float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per rank per step")
    p.add_argument("--block-size", type=_positive_int, default=32, help="context length")
    p.add_argument("--n-layer", type=_positive_int, default=2)
    p.add_argument("--n-head", type=_positive_int, default=2)
    p.add_argument("--n-embd", type=_positive_int, default=64)
    p.add_argument("--dropout", type=_non_negative_float, default=0.0)
    p.add_argument("--exact-reduce", action="store_true",
                   help="plain optimizer: sum gradients in data-rank order (an all-gather), so the bits do not "
                        "depend on the world size: a job that shrank after losing a node stays bit-exact")
    p.add_argument("--num-threads", type=_positive_int, default=1,
                   help="torch intra-op threads; part of the run's identity (see main())")
    p.add_argument("--step-sleep-s", type=_non_negative_float, default=0.0,
                   help="sleep inside each step so a demo can be watched")
    p.add_argument("--log-every", type=_positive_int, default=10, help="print every N steps (rank 0)")
    p.add_argument("--out", default=None, help="write the final weights here (safetensors, rank 0)")
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error(f"--steps must be >= 0, got {args.steps}")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    return args


def save_weights(model: nn.Module, path: str) -> None:
    """Final weights as safetensors (see :func:`save_tensors`)."""
    save_tensors(model.state_dict(), path)


def save_tensors(state: dict[str, torch.Tensor], path: str) -> None:
    """A state dict as safetensors, written to a temporary name and renamed into place,
    so a crash mid-write never leaves a truncated file where a good one was."""
    # clone(): the tied wte/lm_head weights share storage, which safetensors refuses.
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    tmp = f"{path}.tmp"
    save_file(tensors, tmp)
    os.replace(tmp, path)


# -----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # The thread count changes floating-point results, so it is pinned by a flag rather than
    # inherited: a replacement process started after a fault gets the same command line and
    # therefore the same threads and the same bits. 1 is also fastest here: a model this small
    # gains nothing from intra-op threads, and several ranks share few cores.
    torch.set_num_threads(args.num_threads)

    job = unbroken.init()  # joins the job and builds the default process group (gloo on CPU)
    try:  # (the plain optimizer has no shards: any world size will do)
        num_replicas = resolve_num_replicas(args.num_replicas, job.world_size) if args.optimizer == "sharded" else 1
    except ValueError as exc:
        job.close()
        raise SystemExit(f"train_gpt.py: {exc}") from None

    data, vocab = load_data()
    cfg = GPTConfig(vocab_size=len(vocab), block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    torch.manual_seed(args.seed)  # same seed on every rank -> identical initial weights
    model = GPT(cfg).to(job.device)
    opt = build_optimizer(model, args, num_replicas, job)
    warmup_steps = min(args.warmup_steps, args.steps)
    # job.lr_scale: 1, unless the job shrank with --elastic-mode fast --elastic-lr-scaling linear|sqrt.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_multiplier(step, warmup_steps=warmup_steps, total_steps=args.steps) * job.lr_scale)
    # Everything that changes during training and is not a function of the step counter.
    # RNG states and the step counter itself are tracked by unbroken.
    job.track(model=model, optimizer=opt, scheduler=sched)
    params = [p for p in model.parameters() if p.requires_grad]
    # One micro-batch per data-parallel shard this rank runs: its own, and after a node was lost (rung
    # elastic, exact mode) also some of the lost ranks', so the global batch stays the same.
    sync_gradients = args.optimizer == "plain" and (job.world_size > 1 or job.data_world_size > 1)

    if job.rank == 0:
        n_params = sum(p.numel() for p in params)
        print(f"world size {job.world_size}, {n_params / 1e3:.1f}K parameters, vocab {len(vocab)}, "
              f"{len(data)} characters, optimizer {args.optimizer}", flush=True)
    t0 = time.perf_counter()
    for step in job.steps(args.steps):  # starts past 0 when the job resumes after a failure
        with job.step():                # the fault boundary: a failure in here redoes this step
            parts = {}  # --exact-reduce: each micro-batch's gradient apart, by data rank
            for data_rank in job.data_ranks():  # (job.rank,) unless the job shrank: then accumulate
                x, y = get_batch(data, step, data_rank, seed=args.seed, batch_size=args.batch_size,
                                 block_size=args.block_size)
                x, y = x.to(job.device), y.to(job.device)
                _, loss = model(x, y)
                loss.backward()
                if sync_gradients and args.exact_reduce:
                    parts[data_rank] = torch.cat([p.grad.reshape(-1) for p in params])
                    opt.zero_grad(set_to_none=True)
            if sync_gradients and args.exact_reduce:
                sum_gradients_in_data_rank_order(params, parts, job)
            elif sync_gradients:        # job.all_reduce marks phase 'sync' (ShardedOptimizer does this in step())
                all_reduce_gradients(params, job)
            opt.step()                  # a tracked optimizer's step enters 'update': the step commits first
            opt.zero_grad(set_to_none=True)
            sched.step()
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            # Post-step code belongs inside the block: it then runs once per completed step,
            # never for a step a fault dropped (that step is redone, and printed then).
            job.report(loss=loss.item())  # this rank's loss, for the live progress view
            t1 = time.perf_counter()
            if job.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                print(f"step {step}: loss {loss.item():.4f}, lr {sched.get_last_lr()[0]:.2e}, "
                      f"{(t1 - t0) * 1000:.1f} ms", flush=True)
            t0 = t1

    if job.rank == 0 and args.out:
        save_weights(model, args.out)
    job.close()


if __name__ == "__main__":
    main()
