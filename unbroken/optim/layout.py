"""Where every parameter element lives in the flat buffers, and which rank owns which range.

Pure arithmetic; no torch. :class:`FlatLayout` is immutable once built.

The flat space concatenates the trainable parameters of every parameter group in order.
Each group's *region* starts at a multiple of ``align`` elements and is padded up to one,
so shard boundaries never cut a region at an odd place. The space is cut into
``num_shards = world_size / num_replicas`` equal, ``align``-multiple shards
``[s*L, (s+1)*L)``; shard s of group g is the *piece* ``region_g ∩ shard_s``.

Invariants that the bit-exactness across ``num_replicas`` rests on:
* the regions, the parameter offsets and the gradient buckets do not depend on
  ``num_replicas`` (the all-reduce sees the same buffers in the same order for every N);
* every piece starts and ends at a multiple of ``align``, or at the end of its region,
  so an elementwise optimizer sees the same vectorized chunks as on the whole region.
"""

from __future__ import annotations

from unbroken.recovery.replica_map import check_layout
from unbroken.units import round_up

DEFAULT_ALIGN = 64  # elements; a multiple of every SIMD width and of a 256-byte GPU line at fp32


def _split(start: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, end)) for a in range(start, end, size)]


class FlatLayout:
    """Offsets of parameters, group regions, shard pieces and communication buckets.

    ``group_numels[g][i]`` is the element count of trainable parameter i of group g.
    """

    def __init__(self, group_numels: list[list[int]], world_size: int, num_replicas: int,
                 bucket_numel: int, align: int = DEFAULT_ALIGN) -> None:
        check_layout(world_size, num_replicas)
        if align < 1 or bucket_numel < 1:
            raise ValueError(f"align ({align}) and bucket_numel ({bucket_numel}) must be >= 1")
        self.world_size = world_size
        self.num_replicas = num_replicas
        self.num_shards = world_size // num_replicas
        self.align = align
        self.bucket_numel = round_up(bucket_numel, align)
        self.param_offsets: list[list[int]] = []
        self.regions: list[tuple[int, int]] = []
        offset = 0
        for numels in group_numels:
            start = offset
            offsets = []
            for numel in numels:
                offsets.append(offset)
                offset += numel
            self.param_offsets.append(offsets)
            offset = round_up(offset, align)
            self.regions.append((start, offset))
        self.numel = sum(sum(n) for n in group_numels)  # trainable elements, without padding
        self.used_numel = offset  # end of the last region
        self.shard_numel = round_up(max(self.used_numel, 1), self.num_shards * align) // self.num_shards
        self.padded_numel = self.shard_numel * self.num_shards

    def shard_range(self, shard: int) -> tuple[int, int]:
        """The elements ``[start, end)`` that shard ``shard`` owns (trailing padding excluded)."""
        start = min(shard * self.shard_numel, self.used_numel)
        return start, min(start + self.shard_numel, self.used_numel)

    def pieces(self, shard: int) -> list[tuple[int, int]]:
        """Per group, the range of shard ``shard`` inside that group's region (may be empty)."""
        lo, hi = shard * self.shard_numel, (shard + 1) * self.shard_numel
        out = []
        for start, end in self.regions:
            a = min(max(start, lo), end)
            out.append((a, max(min(end, hi), a)))
        return out

    def grad_buckets(self) -> list[tuple[int, int]]:
        """Ranges of the gradient all-reduce; the same for every ``num_replicas``."""
        return _split(0, self.used_numel, self.bucket_numel)

    def gather_chunks(self, shard: int) -> list[tuple[int, int]]:
        """Ranges in which shard ``shard``'s updated parameters are sent to its block."""
        return _split(*self.shard_range(shard), self.bucket_numel)

    def fingerprint(self) -> dict[str, int]:
        """What a per-shard state dict must agree on to be loaded into this layout."""
        return {"world_size": self.world_size, "num_replicas": self.num_replicas,
                "numel": self.numel, "padded_numel": self.padded_numel, "align": self.align,
                "num_groups": len(self.regions)}
