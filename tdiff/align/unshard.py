"""Reassemble a tensor from the shards that tensor- and expert-parallel ranks hold.

Each shard comes with its coordinates (``attrs["parallel"]``: axis -> [rank, size]) and its
shard spec (``attrs["shard"]``: a list of ``{"axis": "tp", "dim": -1}`` for a split dimension or
``{"axis": "tp", "reduce": "sum"}`` for partial sums). An axis of size > 1 that the spec does not
mention holds replicas: they are checked to be bitwise identical and one is kept.

Planning works from metadata alone (which axes, in which order, what is missing); executing
applies the plan to loaded tensors. Axes are undone one at a time: replicas first, then split and
partial axes from the innermost (last listed) outwards.

Examples:
    >>> steps = plan_unshard([{"tp": (0, 2)}, {"tp": (1, 2)}], [{"axis": "tp", "dim": -1}])
    >>> [s.describe() for s in steps]
    ['concatenate 2 tp shards on dim -1']
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tdiff.errors import TdiffError

# Axes whose ranks hold parts of the same tensor. Other axes (data parallel) hold other data.
MODEL_PARALLEL_AXES = ("tp", "etp", "ep")


class UnshardError(TdiffError):
    """Shards that cannot be put back together (a rank is missing, a spec is unsupported)."""


@dataclass(frozen=True)
class UnshardStep:
    axis: str
    size: int
    action: str          # "concat", "sum" or "replicas"
    dim: int | None = None

    def describe(self) -> str:
        if self.action == "concat":
            return f"concatenate {self.size} {self.axis} shards on dim {self.dim}"
        if self.action == "sum":
            return f"sum {self.size} {self.axis} partial sums"
        return f"{self.size} {self.axis} replicas: checked bitwise identical, rank 0's kept"


Coords = dict[str, tuple[int, int]]


def coords_of(attrs: dict) -> Coords:
    """The model-parallel coordinates a record's attrs give (axes of size 1 left out)."""
    parallel = attrs.get("parallel") or {}
    out = {}
    for axis in MODEL_PARALLEL_AXES:
        value = parallel.get(axis)
        if isinstance(value, (list, tuple)) and len(value) == 2 and value[1] > 1:
            out[axis] = (int(value[0]), int(value[1]))
    return out


def plan_unshard(coords: list[Coords], spec: list[dict]) -> list[UnshardStep]:
    """The steps that reassemble shards with these coordinates. Raises UnshardError when the
    shards do not cover every rank exactly once."""
    sizes: dict[str, int] = {}
    for c in coords:
        for axis, (_, size) in c.items():
            if sizes.setdefault(axis, size) != size:
                raise UnshardError(f"shards disagree on the {axis} size ({sizes[axis]} vs {size})")
    by_axis = {entry.get("axis"): entry for entry in spec if isinstance(entry, dict)}
    sizes = _independent(sizes, coords, by_axis)
    expected = 1
    for size in sizes.values():
        expected *= size
    seen = {tuple(sorted((a, r) for a, (r, _) in c.items() if a in sizes)) for c in coords}
    if len(coords) != expected or len(seen) != len(coords):
        have = ", ".join(_coords_text(c) for c in coords) or "none"
        raise UnshardError(f"expected {expected} shard(s) over {_sizes_text(sizes)}, found {have}")
    steps = [UnshardStep(axis, sizes[axis], "replicas") for axis in sizes if axis not in by_axis]
    for entry in reversed(spec):
        axis = entry.get("axis")
        if axis not in sizes:
            continue   # size 1, or moving with an axis already undone
        if entry.get("reduce") == "sum":
            steps.append(UnshardStep(axis, sizes[axis], "sum"))
        elif isinstance(entry.get("dim"), int):
            steps.append(UnshardStep(axis, sizes[axis], "concat", entry["dim"]))
        else:
            raise UnshardError(f"unsupported shard spec {entry}")
    return steps


def _independent(sizes: dict[str, int], coords: list[Coords], by_axis: dict) -> dict[str, int]:
    """Axes whose ranks move together across the shards are one grouping (Megatron's expert
    tensor parallelism follows tensor parallelism by default): keep one of them, preferring an
    axis the shard spec names."""
    order = sorted(sizes, key=lambda a: (a not in by_axis, MODEL_PARALLEL_AXES.index(a)))
    kept: list[str] = []
    for axis in order:
        ranks = [c.get(axis, (0, 1))[0] for c in coords]
        if not any(sizes[k] == sizes[axis] and ranks == [c.get(k, (0, 1))[0] for c in coords] for k in kept):
            kept.append(axis)
    return {axis: sizes[axis] for axis in kept}


def execute_unshard(steps: list[UnshardStep], shards: list[tuple[Coords, torch.Tensor]],
                    warn) -> torch.Tensor:
    """Apply the plan; ``warn(message)`` is told about replicas that differ."""
    axes = {step.axis for step in steps}
    current = [({a: r for a, r in c.items() if a in axes}, t) for c, t in shards]
    for step in steps:
        groups: dict[tuple, list[tuple[int, Coords, torch.Tensor]]] = {}
        for c, t in current:
            rest = tuple(sorted((a, r) for a, r in c.items() if a != step.axis))
            groups.setdefault(rest, []).append((c[step.axis][0], c, t))
        current = []
        for members in groups.values():
            members.sort(key=lambda m: m[0])
            tensors = [t for _, _, t in members]
            coords = {a: r for a, r in members[0][1].items() if a != step.axis}
            current.append((coords, _combine(step, tensors, warn)))
    if len(current) != 1:
        raise UnshardError(f"{len(current)} tensors left after unsharding; the plan is incomplete")
    return current[0][1]


def _combine(step: UnshardStep, tensors: list[torch.Tensor], warn) -> torch.Tensor:
    if step.action == "concat":
        return torch.cat(tensors, dim=step.dim)
    if step.action == "sum":
        out = tensors[0]
        for t in tensors[1:]:
            out = out + t
        return out
    first = tensors[0]
    for rank, other in enumerate(tensors[1:], 1):
        if other.shape != first.shape or other.dtype != first.dtype:
            warn(f"{step.axis} replicas differ: rank {rank} holds {list(other.shape)} {other.dtype}, "
                 f"rank 0 {list(first.shape)} {first.dtype}")
        elif not torch.equal(_bits(other), _bits(first)):
            differing = int((_bits(other) != _bits(first)).sum())
            warn(f"{step.axis} replicas differ: rank {rank} differs from rank 0 in {differing} of "
                 f"{first.numel() * first.element_size()} bytes")
    return first


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _coords_text(c: Coords) -> str:
    return "(" + ", ".join(f"{a} {r}" for a, (r, _) in sorted(c.items())) + ")" if c else "(unsharded)"


def _sizes_text(sizes: dict[str, int]) -> str:
    return ", ".join(f"{a}={n}" for a, n in sorted(sizes.items())) or "no parallel axes"
