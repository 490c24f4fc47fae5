"""`unbroken ckpt ls|show|verify|export DIR`: look into a checkpoint directory.

DIR is a local path or an fsspec URL (`memory://`, `s3://...` with its plugin installed).

Exit codes: 0 fine, 1 corruption found (verify) or nothing to show, 2 bad usage.
Every text that comes from the user or the checkpoint (paths, names, messages) is escaped
before rich prints it: `ck/x[/bold]` prints as it is.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from unbroken.checkpoint import tools
from unbroken.errors import CheckpointError, ConfigError


def _ls(console: Console, args: argparse.Namespace) -> int:
    rows = tools.list_steps(args.dir)
    if not rows:
        console.print(f"no checkpoint steps in {escape(args.dir)}")
        return 1
    table = Table(title=f"checkpoints in {escape(args.dir)}")
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
        table = Table(title=f"rank {rank['rank']}: {escape(rank['file'])} ({rank['bytes']:,} bytes, "
                            f"crc32 {rank['crc32']})")
        for col in ("tensor", "dtype", "shape", "bytes"):
            table.add_column(col)
        for t in rank["tensors"]:
            table.add_row(escape(str(t["name"])), escape(str(t["dtype"])), str(tuple(t["shape"])),
                          f"{t['bytes']:,}")
        console.print(table)
    return 0


def _verify(console: Console, args: argparse.Namespace) -> int:
    problems = tools.verify(args.dir, args.step)
    for p in problems:
        console.print(f"[red]CORRUPT[/red] {escape(p)}")
    if problems:
        return 1
    console.print(f"ok: every committed step{'' if args.step is None else f' ({args.step})'} in "
                  f"{escape(args.dir)} verifies")
    return 0


def _export(console: Console, args: argparse.Namespace) -> int:
    if not args.out:
        raise ConfigError("ckpt export needs --out PATH (where to write the consolidated weights: "
                          "a file, or a new directory for --format dcp)")
    info = tools.export(args.dir, args.out, step=args.step, fmt=args.format)
    console.print(f"exported step {info['step']} ({info['tensors']} tensors, {info['bytes']:,} bytes) "
                  f"to {escape(info['path'])}")
    return 0


def run_ckpt(args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True)  # a path is never broken across lines
    actions = {"ls": _ls, "show": _show, "verify": _verify, "export": _export}
    try:
        return actions[args.action](console, args)
    except ConfigError:
        raise
    except CheckpointError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 1
    except OSError as exc:  # e.g. a directory that became unreadable midway: no traceback
        console.print(f"[red]error:[/red] {escape(args.dir)}: {escape(exc.strerror or str(exc))}"
                      f"{escape(f' ({exc.filename})') if exc.filename else ''}")
        return 1
