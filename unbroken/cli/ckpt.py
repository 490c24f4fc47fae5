"""`unbroken ckpt ls|show|verify|export DIR`: look into a checkpoint directory.

DIR is a local path or an fsspec URL (`memory://`, `s3://...` with its plugin installed).

Exit codes: 0 fine, 1 corruption found (verify) or nothing to show, 2 bad usage.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from unbroken.checkpoint import tools
from unbroken.errors import CheckpointError, ConfigError


def _ls(console: Console, args: argparse.Namespace) -> int:
    rows = tools.list_steps(args.dir)
    if not rows:
        console.print(f"no checkpoint steps in {args.dir}")
        return 1
    table = Table(title=f"checkpoints in {args.dir}")
    for col in ("step", "committed", "latest", "world size", "ranks", "bytes"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["step"]), "yes" if r["committed"] else "no", "*" if r["latest"] else "",
                      str(r.get("world_size") or "-"), str(len(r.get("ranks") or ())), f"{r.get('bytes', 0):,}")
    console.print(table)
    return 0


def _show(console: Console, args: argparse.Namespace) -> int:
    info = tools.show_step(args.dir, args.step)
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("created_unix", 0)))
    console.print(f"step {info['step']}, world size {info['world_size']}, committed {created}")
    for rank in info["ranks"]:
        table = Table(title=f"rank {rank['rank']}: {rank['file']} ({rank['bytes']:,} bytes, crc32 {rank['crc32']})")
        for col in ("tensor", "dtype", "shape", "bytes"):
            table.add_column(col)
        for t in rank["tensors"]:
            table.add_row(t["name"], t["dtype"], str(tuple(t["shape"])), f"{t['bytes']:,}")
        console.print(table)
    return 0


def _verify(console: Console, args: argparse.Namespace) -> int:
    problems = tools.verify(args.dir, args.step)
    for p in problems:
        console.print(f"[red]CORRUPT[/red] {p}")
    if problems:
        return 1
    console.print(f"ok: every committed step{'' if args.step is None else f' ({args.step})'} in {args.dir} "
                  "verifies")
    return 0


def _export(console: Console, args: argparse.Namespace) -> int:
    if not args.out:
        raise ConfigError("ckpt export needs --out PATH (where to write the consolidated weights: "
                          "a file, or a new directory for --format dcp)")
    info = tools.export(args.dir, args.out, step=args.step, fmt=args.format)
    console.print(f"exported step {info['step']} ({info['tensors']} tensors, {info['bytes']:,} bytes) "
                  f"to {info['path']}")
    return 0


def run_ckpt(args: argparse.Namespace) -> int:
    console = Console()
    actions = {"ls": _ls, "show": _show, "verify": _verify, "export": _export}
    try:
        return actions[args.action](console, args)
    except ConfigError:
        raise
    except CheckpointError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1
