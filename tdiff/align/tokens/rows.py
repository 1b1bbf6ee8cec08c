"""Where a tensor's rows sit in the token layout: each row located as (sequence, position).

A forward's token grid is ``[batch, seq]`` or ``[tokens]`` (tdiff.store.tokens). A tensor of that
forward holds one row per grid cell when its leading dims are the grid (``grid``), the grid
transposed (``seq-major``: Megatron's ``[seq, batch, ...]``) or the grid's cells flattened
(``flat``: SGLang's ``[tokens, ...]``, and every canonical tensor, whose tokens come first in
natural order). An explicit dump made with ``positions=`` says where its rows sit itself
(``rows``). Padding cells are dropped; a tensor matching none of these is not token-shaped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tdiff.align.tokens.sequences import SequenceIndex
from tdiff.errors import TdiffError
from tdiff.store import Record
from tdiff.store.tokens import FRAMEWORK_LAYOUTS, PADDING, RowTokens, TokenBatch


@dataclass(frozen=True)
class Located:
    """One tensor's rows that are tokens: ``rows[i]`` of the row-major tensor stands for the
    token ``(sequences[i], positions[i])``."""

    mode: str                      # "grid", "seq-major", "flat" or "rows"
    lead: tuple[int, ...]          # the leading dims that hold the rows (as stored)
    rows: list[int]
    sequences: list[int]
    positions: list[int]

    @property
    def count(self) -> int:
        return math.prod(self.lead)

    def features(self, record: Record) -> tuple[int, ...]:
        return record.shape[len(self.lead):]

    def as_rows(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The tensor as ``[count, ...]``, one row per located cell (stored or canonical layout)."""
        lead = len(self.lead)
        if self.mode == "seq-major" and tuple(tensor.shape[:2]) == self.lead:
            return tensor.transpose(0, 1).reshape(self.count, *tensor.shape[2:])
        if tuple(tensor.shape[:lead]) == self.lead:
            return tensor.reshape(self.count, *tensor.shape[lead:])
        if tensor.dim() and tensor.shape[0] == self.count:
            return tensor   # a canonical tensor: tokens first, in natural order
        raise TdiffError(f"{name}: a tensor of shape {list(tensor.shape)} has no row per token of its forward "
                         f"({list(self.lead)}); align it by name or boundary (--align)")


def locate(record: Record, batch: TokenBatch | None, index: SequenceIndex,
           cache: dict[tuple, Located]) -> Located | str:
    """The token rows of ``record`` (its step and rank's forward is ``batch``), or why it has none.
    ``cache`` keeps what the records of one forward share (the same grid, the same rows)."""
    explicit = RowTokens.of(record.attrs, record.name)
    if explicit is not None:
        if batch is None:
            return f"step {record.step} has no token metadata on rank {record.rank}"
        rows = []
        for row, (seq, position) in enumerate(zip(explicit.seqs, explicit.positions)):
            found = index.of(record.step, record.rank, seq)
            if found is not None:
                rows.append((row, found, position))
        return _located("rows", explicit.shape, rows)
    if batch is None:
        return f"step {record.step} has no token metadata on rank {record.rank}"
    mode = _mode(record, batch.shape)
    if mode is None:
        return (f"shape {list(record.shape)} has no row per token of step {record.step}'s token grid "
                f"{list(batch.shape)}")
    key = (record.step, record.rank, mode)
    if key not in cache:
        cache[key] = _grid_rows(record.step, record.rank, mode, batch, index)
    return cache[key]


def _grid_rows(step: int, rank: int, mode: str, batch: TokenBatch, index: SequenceIndex) -> Located:
    lead = {"grid": batch.shape, "seq-major": tuple(reversed(batch.shape)), "flat": (batch.cells,)}[mode]
    located = []
    for cell, (seq, position) in enumerate(zip(batch.seqs, batch.positions)):
        found = index.of(step, rank, seq) if seq != PADDING else None
        if found is not None:
            located.append((cell, found, position))   # as_rows puts a seq-major tensor's rows in grid order
    return _located(mode, lead, located)


def _mode(record: Record, grid: tuple[int, ...]) -> str | None:
    shape = record.shape
    seq_major = len(grid) == 2 and tuple(shape[:2]) == (grid[1], grid[0])
    # what capture read of the module (its batch_first, its framework's); else the framework's
    layout = record.attrs.get("layout") or FRAMEWORK_LAYOUTS.get(record.attrs.get("framework", ""))
    if seq_major and layout == "seq-first":
        return "seq-major"   # [seq, batch, ...] (even where seq == batch)
    if tuple(shape[:len(grid)]) == grid:
        if seq_major and layout is None:   # a square grid: [batch, seq] and [seq, batch] read alike
            raise TdiffError(
                f"{record.name}: shape {list(shape)} may be [batch, seq] or [seq, batch] over step {record.step}'s "
                f"square token grid {list(grid)}, and nothing declares which; declare it: give the module a "
                "batch_first attribute (torch.nn's convention), or dump the value with tdiff.dump(..., positions=P)")
        return "grid"
    if seq_major:
        return "seq-major"
    if shape and shape[0] == math.prod(grid) and len(grid) == 2:
        return "flat"
    return None


def _located(mode: str, lead: tuple[int, ...], located: list[tuple[int, int, int]]) -> Located:
    located.sort()
    return Located(mode, tuple(lead), [r for r, _, _ in located], [s for _, s, _ in located],
                   [p for _, _, p in located])
