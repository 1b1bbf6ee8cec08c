"""Where a tensor's rows sit in the token layout: each row located as (sequence, position).

A forward's token grid is ``[batch, seq]`` or ``[tokens]`` (tdiff.store.tokens). A tensor of that
forward holds one row per grid cell when its leading dims are the grid (``grid``), the grid
transposed (``seq-major``: Megatron's ``[seq, batch, ...]``) or the grid's cells flattened
(``flat``: SGLang's ``[tokens, ...]``, and every canonical tensor, whose tokens come first in
natural order), or the ``[tokens]`` grid under a batch of one (``packed``: THD's ``[1, tokens]``
input ids). A table indexed by position alone (``positions``: RoPE's cos/sin ``[1, seq, dim]``
shared by a ``[batch, seq]`` batch, ``[1, 1, dim]`` in a decode step) stands, row j, for every
token of grid column j, when they all sit at one position. An engine's rows per sequence
(``last``: ``[num_seqs, vocab]`` or ``[num_seqs, 1, vocab]`` logits of each sequence's last token,
SGLang's logits processor in a prefill, Hugging Face's ``generate``) stand, row s, for sequence
s's last position fed in this forward. An explicit dump made with ``positions=`` says where its rows sit itself
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

    mode: str                      # "grid", "seq-major", "flat", "packed", "positions", "last" or "rows"
    lead: tuple[int, ...]          # the leading dims that hold the rows (as stored)
    rows: list[int]
    sequences: list[int]
    positions: list[int]
    strays: int = 0                # rows of an explicit dump naming a sequence its forward does not hold

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
        for row, (seq, position) in enumerate(zip(_row_sequences(explicit, batch), explicit.positions)):
            found = index.of(record.step, record.rank, seq)
            if found is not None:
                rows.append((row, found, position))
        return _located("rows", explicit.shape, rows, strays=len(explicit.seqs) - len(rows))
    if batch is None:
        return f"step {record.step} has no token metadata on rank {record.rank}"
    mode = _mode(record, batch)
    if mode is None:
        return (f"shape {list(record.shape)} has no row per token of step {record.step}'s token grid "
                f"{list(batch.shape)}")
    key = (record.step, record.rank, mode)
    if key not in cache:
        cache[key] = _grid_rows(record.step, record.rank, mode, batch, index)
    return cache[key]


def _row_sequences(explicit: RowTokens, batch: TokenBatch) -> list[int]:
    """Each explicit row's sequence in its forward. A 1-D ``positions=`` without ``seq_ids`` names
    by default the element's index as its sequence: right for a decode step (a row per sequence),
    not for a prefill's rows (a row per token, sequence after sequence). Where the element indices
    do not fit the forward (a sequence it lacks, a position past one's tokens), the rows are read
    as runs of rising positions, one per sequence of the forward in order, when they fit that."""
    positions, seqs = explicit.positions, explicit.seqs
    if len(explicit.shape) != 1 or seqs != list(range(len(seqs))):
        return seqs
    spans: dict[int, tuple[int, int]] = {}
    for seq, position in zip(batch.seqs, batch.positions):
        if seq != PADDING:
            low, high = spans.get(seq, (position, position))
            spans[seq] = (min(low, position), max(high, position))

    def fits(seq: int, position: int) -> bool:
        return seq in spans and spans[seq][0] <= position <= spans[seq][1] + 1   # a log-prob scores the next

    if all(fits(seq, position) for seq, position in zip(seqs, positions)):
        return seqs
    runs, current = [], -1
    for k, position in enumerate(positions):
        if k == 0 or position <= positions[k - 1]:
            current += 1
        runs.append(current)
    order = sorted(spans)
    if current + 1 != len(order):
        return seqs
    resolved = [order[run] for run in runs]
    return resolved if all(fits(seq, position) for seq, position in zip(resolved, positions)) else seqs


def _grid_rows(step: int, rank: int, mode: str, batch: TokenBatch, index: SequenceIndex) -> Located:
    if mode.startswith("last"):
        return _last_rows(step, rank, mode, batch, index)
    lead = {"grid": batch.shape, "seq-major": tuple(reversed(batch.shape)), "flat": (batch.cells,),
            "packed": (1, batch.cells), "positions": (1, batch.shape[-1])}[mode]
    located = []
    for cell, (seq, position) in enumerate(zip(batch.seqs, batch.positions)):
        found = index.of(step, rank, seq) if seq != PADDING else None
        if found is not None:
            # as_rows puts a seq-major tensor's rows in grid order; a position table's row is the column
            row = cell % batch.shape[-1] if mode == "positions" else cell
            located.append((row, found, position))
    return _located(mode, lead, located)


def _last_rows(step: int, rank: int, mode: str, batch: TokenBatch, index: SequenceIndex) -> Located:
    last: dict[int, int] = {}
    for seq, position in zip(batch.seqs, batch.positions):
        if seq != PADDING:
            last[seq] = max(last.get(seq, position), position)
    located = []
    for seq, position in last.items():
        found = index.of(step, rank, seq)
        if found is not None:
            located.append((seq, found, position))
    lead = (batch.sequences, 1) if mode == "last-kept" else (batch.sequences,)
    return _located(mode, lead, located)


def _mode(record: Record, batch: TokenBatch) -> str | None:
    shape, grid = record.shape, batch.shape
    seq_major = len(grid) == 2 and tuple(shape[:2]) == (grid[1], grid[0])
    # what capture read of the module (its batch_first, its framework's); else the framework's
    layout = record.attrs.get("layout") or FRAMEWORK_LAYOUTS.get(record.attrs.get("framework", ""))
    if seq_major and layout == "seq-first":
        return "seq-major"   # [seq, batch, ...] (even where seq == batch)
    if tuple(shape[:len(grid)]) == grid:
        # a square grid of more than one token: [batch, seq] and [seq, batch] read alike but differ
        if seq_major and layout is None and grid[0] > 1:
            raise TdiffError(
                f"{record.name}: shape {list(shape)} may be [batch, seq] or [seq, batch] over step {record.step}'s "
                f"square token grid {list(grid)}, and nothing declares which; declare it: give the module a "
                "batch_first attribute (torch.nn's convention), or dump the value with "
                "tdiff.dump(..., layout='batch-first' or 'seq-first') or tdiff.dump(..., positions=P)")
        return "grid"
    if seq_major:
        return "seq-major"
    if shape and shape[0] == math.prod(grid) and len(grid) == 2:
        return "flat"
    if len(grid) == 1 and tuple(shape[:2]) == (1, grid[0]):
        return "packed"
    if len(grid) == 2 and tuple(shape[:2]) == (1, grid[1]) and _one_position_per_column(batch):
        return "positions"
    if len(shape) == 2 and shape[0] == batch.sequences:
        return "last"
    if len(shape) == 3 and (shape[0], shape[1]) == (batch.sequences, 1):
        return "last-kept"   # Hugging Face's logits_to_keep=1: [batch, 1, vocab]
    return None


def _one_position_per_column(batch: TokenBatch) -> bool:
    """Whether the tokens of each grid column sit at one position (no left padding shifts them)."""
    width = batch.shape[-1]
    column: dict[int, int] = {}
    for cell, (seq, position) in enumerate(zip(batch.seqs, batch.positions)):
        if seq != PADDING and column.setdefault(cell % width, position) != position:
            return False
    return True


def _located(mode: str, lead: tuple[int, ...], located: list[tuple[int, int, int]], strays: int = 0) -> Located:
    located.sort()
    return Located(mode, tuple(lead), [r for r, _, _ in located], [s for _, s, _ in located],
                   [p for _, _, p in located], strays)
