"""Small arithmetic on sizes shared by the checkpoint and optimizer layouts. Pure."""

from __future__ import annotations


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n`` (``multiple`` >= 1)."""
    return -(-n // multiple) * multiple


def format_bytes(n: int) -> str:
    """``n`` bytes for a message: GiB from 1 GiB up, else MiB."""
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
