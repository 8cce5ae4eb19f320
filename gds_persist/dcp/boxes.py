"""Where the bytes of a saved DCP chunk land in a planner's target: pure tensor indexing, no I/O.

A saved chunk is stored row-major and contiguous; the reader sees it as runs of elements (one
staging buffer's worth at a time). A read item asks for a box of the chunk (``storage_offsets``,
``lengths``) and the planner's target is a tensor of the box's shape, of any strides, dtype or
device. :func:`copy_run` copies the part of one run that falls inside the box into the target, in
at most two partial rows per dimension plus one block of whole rows, so no copy of the chunk is
ever made.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int],
           first_dim: int = 0) -> torch.Tensor:
    """``t`` narrowed to the box ``offsets``/``lengths`` from dimension ``first_dim`` on."""
    for dim, (o, n) in enumerate(zip(offsets, lengths, strict=True), start=first_dim):
        t = t.narrow(dim, int(o), int(n))
    return t


def copy_run(run: torch.Tensor, start: int, shape: Sequence[int], offsets: Sequence[int],
             lengths: Sequence[int], target: torch.Tensor) -> None:
    """Copy ``run``, the flat elements ``[start, start + run.numel())`` of a row-major chunk of
    ``shape``, into ``target``: wherever they fall inside the box ``offsets``/``lengths`` of
    that chunk (``target.shape == lengths``; ``copy_`` converts dtype and device)."""
    n = run.numel()
    if n == 0:
        return
    if not shape:  # a 0-d chunk: one element
        target.copy_(run.reshape(()))
        return
    inner = 1
    for d in shape[1:]:
        inner *= int(d)
    end = start + n
    box_lo, box_hi = int(offsets[0]), int(offsets[0]) + int(lengths[0])

    def row(i: int, lo: int, hi: int) -> None:  # elements [lo, hi) of row i, a partial row
        if box_lo <= i < box_hi:
            copy_run(run[lo - start : hi - start], lo - i * inner, shape[1:], offsets[1:],
                     lengths[1:], target[i - box_lo])

    first, last = start // inner, (end - 1) // inner  # the rows the run touches
    if first == last and n < inner:
        row(first, start, end)
        return
    full_lo, full_hi = first, last + 1
    if start % inner:
        row(first, start, (first + 1) * inner)
        full_lo += 1
    if end % inner:
        row(last, last * inner, end)
        full_hi -= 1
    lo, hi = max(full_lo, box_lo), min(full_hi, box_hi)
    if lo < hi:  # whole rows: one block copy
        block = run[lo * inner - start : hi * inner - start].view(hi - lo, *shape[1:])
        target[lo - box_lo : hi - box_lo].copy_(narrow(block, offsets[1:], lengths[1:], 1))
