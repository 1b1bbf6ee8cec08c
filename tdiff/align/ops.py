"""The steps that turn stored tensors into a canonical one. Each step says what it does
(``describe``), so that the comparison can show how two tensors were aligned.

Two sorts: a *combine* step builds one tensor from the records of one shard (most take the first
record as it is; some add a returned bias or rebuild top-k ids from a routing map), a *transform*
step changes one tensor (select a part of a fused output, move tokens first, reorder rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


# ---- combine: the records of one shard -> one tensor ----
class Combine(Protocol):
    def describe(self, names: list[str]) -> str: ...

    def apply(self, tensors: list[torch.Tensor]) -> torch.Tensor: ...


@dataclass(frozen=True)
class Take:
    """The first record as stored."""

    def describe(self, names: list[str]) -> str:
        return names[0]

    def apply(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0]


@dataclass(frozen=True)
class Add:
    """The sum of the records: a linear layer's separately returned bias, or a residual stream
    rebuilt from its two summands."""

    why: str

    def describe(self, names: list[str]) -> str:
        return f"{' + '.join(names)} ({self.why})"

    def apply(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        out = tensors[0]
        for t in tensors[1:]:
            out = out + t
        return out


@dataclass(frozen=True)
class SortedTopk:
    """Top-k ids (and the weights beside them) sorted by expert id, so that frameworks that list
    a token's experts by score and those that list them by id agree. Records: [values, ids]."""

    part: str  # "ids" or "weights"

    def describe(self, names: list[str]) -> str:
        return f"{names[0]} ordered by ascending expert id (ids from {names[-1]})"

    def apply(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        values, ids = tensors[0], tensors[-1]
        ids = ids.reshape(-1, ids.shape[-1])
        order = ids.argsort(dim=-1, stable=True)
        if self.part == "ids":
            return ids.gather(-1, order)
        return values.reshape(ids.shape).gather(-1, order)


@dataclass(frozen=True)
class TopkFromRoutingMap:
    """Top-k ids or weights from a dense [tokens, experts] routing map and probabilities
    (Megatron's router output). Records: [probs, routing_map]."""

    part: str  # "ids" or "weights"

    def describe(self, names: list[str]) -> str:
        source = names[-1] if self.part == "ids" else f"{names[0]} at {names[-1]}"
        return f"top-k {self.part}: {source}, experts in ascending id"

    def apply(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        probs, routing_map = tensors[0], tensors[-1].bool()
        per_token = routing_map.sum(-1)
        k = int(per_token.max()) if per_token.numel() else 0
        if per_token.numel() and not bool((per_token == k).all()):
            raise ValueError("routing map does not select the same number of experts for every token")
        if self.part == "ids":
            ids = torch.arange(routing_map.shape[-1]).expand_as(routing_map)
            return ids[routing_map].reshape(-1, k)
        return probs[routing_map].reshape(-1, k)


# ---- transform: one tensor -> one tensor ----
@dataclass(frozen=True)
class Narrow:
    """A slice of the last dimension: one part of a fused output (q of q|k|v, gate of gate|up)."""

    start: int
    length: int
    label: str

    def describe(self) -> str:
        return f"take {self.label}: last dim [{self.start}:{self.start + self.length}]"

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(-1, self.start, self.length)


@dataclass(frozen=True)
class Halve:
    """One half of the last dimension (gate|up fused by column)."""

    index: int
    label: str

    def describe(self) -> str:
        return f"take {self.label}: {'first' if self.index == 0 else 'second'} half of the last dim"

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return t.chunk(2, dim=-1)[self.index]


@dataclass(frozen=True)
class GroupedQKV:
    """q, k or v out of a QKV projection ordered per query group (Megatron): for each group, its
    query heads, then its key head, then its value head."""

    groups: int
    heads_per_group: int
    head_dim: int
    part: str  # "q", "k" or "v"

    def describe(self) -> str:
        return (f"take {self.part} from QKV ordered per query group "
                f"({self.groups} group(s) of {self.heads_per_group} q + 1 k + 1 v heads of {self.head_dim})")

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        d, per = self.head_dim, self.heads_per_group
        grouped = t.reshape(*t.shape[:-1], self.groups, (per + 2) * d)
        start, length = {"q": (0, per * d), "k": (per * d, d), "v": ((per + 1) * d, d)}[self.part]
        return grouped.narrow(-1, start, length).reshape(*t.shape[:-1], -1)


@dataclass(frozen=True)
class TokensFirst:
    """To the canonical [tokens, features] layout, tokens in natural order (sequence-major).

    ``order`` names the stored leading dims: "bs" [batch, seq, ...], "sb" [seq, batch, ...]
    (Megatron; a 2-D tensor there already has one row per token), "t" [tokens, ...] (SGLang,
    and tensors already flattened in natural order).
    """

    order: str

    def describe(self) -> str:
        if self.order == "sb":
            return "[seq, batch, ...] -> [tokens, features]"
        if self.order == "bs":
            return "[batch, seq, ...] -> [tokens, features]"
        return "-> [tokens, features]"

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        if self.order == "sb" and t.dim() >= 3:
            t = t.transpose(0, 1)
        if (self.order == "sb" and t.dim() >= 3) or (self.order == "bs" and t.dim() >= 2):
            t = t.flatten(0, 1)
        return t.reshape(t.shape[0], -1) if t.dim() > 2 else t


@dataclass(frozen=True)
class ExpandBatch:
    """[1, seq] ids shared by every sequence of a batch (HF position ids) -> [batch, seq]."""

    batch: int

    def describe(self) -> str:
        return f"expand [1, seq] to the batch of {self.batch}"

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return t.expand(self.batch, *t.shape[1:]) if t.shape[0] == 1 else t


@dataclass(frozen=True)
class SeqMajorRows:
    """Rows flattened from [seq, batch] (Megatron's MoE token order) to natural token order."""

    batch: int

    def describe(self) -> str:
        return f"rows from [seq, batch={self.batch}] order to natural token order"

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        if self.batch == 1:
            return t
        return t.reshape(-1, self.batch, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
