"""First-fit placement of temporaries into result buffers (``memory._pooled``), answered with
bitsets so one query costs O(log positions) whatever the number of buffers.

A buffer ("slot") is a bit of a Python int. ``Slots.first_free(a, b, fit)`` is the lowest slot
below ``fit`` that is written after position ``b`` and holds no placed temporary meeting
``[a, b]``; ``place(k, a, b)`` records one. The placed temporaries live in a segment tree over
schedule positions: each node keeps ``tag`` (slots occupied at every position of its range) and
``agg`` (slots occupied anywhere in its range), so the slots busy somewhere in ``[a, b]`` are
the ``agg`` of the range's canonical nodes or-ed with the ``tag`` of their ancestors (every such
ancestor contains ``a`` or ``b``: the paths from those two leaves hold them all). Testing every
buffer one temporary at a time made a 96-layer unrolled model's estimate grow with the square
of its depth."""
from __future__ import annotations

import bisect
from collections.abc import Sequence


class Slots:
    """Result buffers written at ``written[k]`` (schedule positions), for temporaries placed at
    positions ``0 .. positions - 1``."""

    def __init__(self, written: Sequence[int], positions: int):
        self.size = 1 << max(positions - 1, 0).bit_length()
        self.tag = [0] * (2 * self.size)
        self.agg = [0] * (2 * self.size)
        order = sorted(range(len(written)), key=written.__getitem__)
        self.by_written = [written[k] for k in order]
        self.done_by = [0]              # done_by[i]: the i slots written first, as bits
        for k in order:
            self.done_by.append(self.done_by[-1] | (1 << k))

    def first_free(self, a: int, b: int, fit: int) -> int | None:
        free = self.free(a, b, fit)
        return (free & -free).bit_length() - 1 if free else None

    def free(self, a: int, b: int, fit: int) -> int:
        """The slots ``first_free`` chooses from, as bits."""
        done = self.done_by[bisect.bisect_right(self.by_written, b)]
        return ((1 << fit) - 1) & ~done & ~self._busy(a, b)

    def place(self, k: int, a: int, b: int) -> None:
        self.place_bits(1 << k, a, b)

    def place_bits(self, bit: int, a: int, b: int) -> None:
        """``place`` for every slot in ``bit`` (a mask) at once."""
        tag, agg = self.tag, self.agg
        lo, hi = a + self.size, b + self.size + 1
        while lo < hi:
            if lo & 1:
                tag[lo] |= bit
                agg[lo] |= bit
                lo += 1
            if hi & 1:
                hi -= 1
                tag[hi] |= bit
                agg[hi] |= bit
            lo, hi = lo >> 1, hi >> 1
        for leaf in (a + self.size, b + self.size):
            node = leaf >> 1
            while node:
                agg[node] |= bit
                node >>= 1

    def _busy(self, a: int, b: int) -> int:
        """The slots holding a temporary that meets ``[a, b]``, as bits."""
        busy, tag, agg = 0, self.tag, self.agg
        lo, hi = a + self.size, b + self.size + 1
        while lo < hi:
            if lo & 1:
                busy |= agg[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                busy |= agg[hi]
            lo, hi = lo >> 1, hi >> 1
        for leaf in (a + self.size, b + self.size):
            node = leaf >> 1
            while node:
                busy |= tag[node]
                node >>= 1
        return busy
