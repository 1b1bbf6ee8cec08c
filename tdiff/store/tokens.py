"""Token metadata: which token of which sequence each row of a forward's tensors stands for.

One :class:`TokenBatch` per forward (step) and rank, stored as a ``"tokens"`` line of the
writing process's manifest (format version 2, docs/FORMAT.md). A forward's tokens lie on a
*grid*: ``[batch, seq]`` for padded rows (Hugging Face, Megatron's input_ids), ``[tokens]`` for
ragged or packed batches (SGLang, THD). Every grid cell has its token id, its position (0-based
from the start of its sequence) and the index of its sequence in this forward (-1: padding).

Explicit dumps given positions (``tdiff.dump(name, value, positions=P, seq_ids=S)``) carry them
in ``attrs["tokens"]``: :class:`RowTokens`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tdiff.errors import DumpError

PADDING = -1   # the sequence index of a grid cell that holds no token
# how a framework's activations lay out a [batch, seq] grid, where its modules declare nothing
# (attrs "layout"): Megatron's are [seq, batch, ...], transformers' [batch, seq, ...]
LAYOUTS = ("batch-first", "seq-first")   # how a value lays out a 2-D token grid: [batch, seq] or [seq, batch]
FRAMEWORK_LAYOUTS = {"megatron": "seq-first", "transformers": "batch-first", "sglang": "batch-first"}


@dataclass(frozen=True)
class DeferredTokens:
    """A forward's token metadata that the writer works out, off the model's thread: ``describe``
    makes its :class:`TokenBatch` from copies of what the model was given, once the ``ready``
    events (those of copies from a device) have passed."""

    step: int
    describe: Callable[[], TokenBatch]
    ready: tuple[Any, ...] = ()

    def resolve(self) -> TokenBatch:
        for event in self.ready:
            event.synchronize()
        return self.describe()


@dataclass(frozen=True)
class TokenBatch:
    """The tokens of one forward on one rank; lists are flat over the grid, row-major."""

    step: int
    rank: int
    shape: tuple[int, ...]          # the token grid: [batch, seq] or [tokens]
    input_ids: list[int]
    positions: list[int]
    seqs: list[int]                 # per cell: index of its sequence in this forward, PADDING for none
    sequences: int                  # how many sequences this forward holds
    seq_ids: list | None = None     # per sequence: its request id (str or int), when known
    prompt_lens: list[int] | None = None   # per sequence: tokens of its prompt, when known
    source: str = "tokens"          # who described it: "tokens" (tdiff.tokens) or a framework

    @property
    def cells(self) -> int:
        return len(self.input_ids)

    def to_json(self) -> dict:
        out = {"step": self.step, "rank": self.rank, "shape": list(self.shape), "input_ids": self.input_ids,
               "positions": self.positions, "seqs": self.seqs, "sequences": self.sequences, "source": self.source}
        if self.seq_ids is not None:
            out["seq_ids"] = self.seq_ids
        if self.prompt_lens is not None:
            out["prompt_lens"] = self.prompt_lens
        return out

    @classmethod
    def from_json(cls, data: dict, where: str) -> TokenBatch:
        step, rank, sequences = (_count(data, key, where) for key in ("step", "rank", "sequences"))
        shape = tuple(_ints(data, "shape", where))
        cells = 1
        for n in shape:
            cells *= n
        lists = {key: _ints(data, key, where) for key in ("input_ids", "positions", "seqs")}
        for key, values in lists.items():
            if len(values) != cells:
                raise DumpError(f"{where}: tokens field {key!r} has {len(values)} entries, its grid {list(shape)} "
                                f"{cells}")
        if any(s < PADDING or s >= sequences for s in lists["seqs"]):
            raise DumpError(f"{where}: tokens field 'seqs' names a sequence outside 0..{sequences - 1}")
        seq_ids = data.get("seq_ids")
        if seq_ids is not None and (not isinstance(seq_ids, list) or len(seq_ids) != sequences
                                    or not all(isinstance(s, (str, int)) and not isinstance(s, bool) for s in seq_ids)):
            raise DumpError(f"{where}: tokens field 'seq_ids' must list one id (text or integer) per sequence")
        prompt_lens = _ints(data, "prompt_lens", where) if data.get("prompt_lens") is not None else None
        if prompt_lens is not None and len(prompt_lens) != sequences:
            raise DumpError(f"{where}: tokens field 'prompt_lens' must give one length per sequence")
        if sequences > cells and seq_ids is None and prompt_lens is None:
            # readers go sequence by sequence: a count no cell or per-sequence list backs is refused
            raise DumpError(f"{where}: tokens field 'sequences' claims {sequences} sequences, more than the "
                            f"{cells} cells of its grid; the dump is corrupted")
        source = data.get("source", "tokens")
        if not isinstance(source, str):
            raise DumpError(f"{where}: tokens field 'source' must be text")
        return cls(step, rank, shape, lists["input_ids"], lists["positions"], lists["seqs"], sequences,
                   seq_ids, prompt_lens, source)


@dataclass(frozen=True)
class RowTokens:
    """The positions an explicit dump's rows stand for: flat over the value's leading ``shape``."""

    shape: tuple[int, ...]
    positions: list[int]
    seqs: list[int]     # per row: index of its sequence in the forward (step) the dump was made in

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "positions": self.positions, "seqs": self.seqs}

    @classmethod
    def of(cls, attrs: dict, where: str = "record") -> RowTokens | None:
        data = attrs.get("tokens")
        if data is None:
            return None
        if not isinstance(data, dict):
            raise DumpError(f"{where}: attrs 'tokens' must be an object")
        shape = tuple(_ints(data, "shape", where))
        positions, seqs = _ints(data, "positions", where), _ints(data, "seqs", where)
        cells = 1
        for n in shape:
            cells *= n
        if len(positions) != cells or len(seqs) != cells:
            raise DumpError(f"{where}: attrs 'tokens' must give a position and a sequence per row of {list(shape)}")
        return cls(shape, positions, seqs)


def _count(data: dict, key: str, where: str) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DumpError(f"{where}: tokens field {key!r} must be a non-negative integer")
    return value


def _ints(data: dict, key: str, where: str) -> list[int]:
    value = data.get(key)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DumpError(f"{where}: tokens field {key!r} must be a list of integers")
    return value
