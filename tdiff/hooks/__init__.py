"""Capture: module hooks and explicit dumps that write a tdiff dump."""

from __future__ import annotations

import torch

from tdiff.hooks.active import active_capture
from tdiff.hooks.capture import Capture
from tdiff.hooks.cuda_graphs import graph_replayed, graph_rows, warmup


def capture(out_dir, *, side=None, select=(), exclude=(), layers=None, steps=None, mode="full",
            storage="safetensors", model=None, **options) -> Capture:
    """Record module inputs and outputs into ``out_dir`` while the ``with`` block runs.

    Args:
        out_dir: the dump directory (created; several processes may share it).
        side: a label for reports (defaults to the directory name).
        select / exclude: regexes searched in module paths (and explicit dump names, for exclude).
        layers / steps: ranges like "0-3,7" (or ints, or lists) restricting what is recorded.
        mode: "full" stores tensors; "stats" stores fingerprints and statistics only.
        storage: "safetensors" or "h5".
        model: the outermost model; names are taken from it and its ``forward`` is wrapped too.
        options: ``max_pending_bytes`` (host memory held by pending writes, default 2 GiB),
            ``shard_bytes`` (shard size cap), ``batch_row`` (record only this row of every tensor
            whose leading dimension is the batch size of the outermost call's first input: one
            sequence of a batch, to compare with the same sequence scored alone),
            ``graph_budget_bytes`` (GPU memory for the static buffers that record tensors inside
            CUDA graphs, default 1 GiB; past it, the rest of a graph is recorded as statistics).
    """
    return Capture(out_dir, side=side, select=select, exclude=exclude, layers=layers, steps=steps,
                   mode=mode, storage=storage, model=model, **options)


def dump(name: str, value):
    """Record ``value`` (a tensor or a nested structure of them) under ``name``; returns ``value``.

    A no-op when no capture is active, so the call can stay in user code, and inside code that
    torch.compile compiles (which then compiles as if the call were not there).
    """
    if torch.compiler.is_compiling():
        return value
    active = active_capture()
    if active is not None:
        active.dump(name, value)
    return value


def step() -> None:
    """Advance the step index (from then on, only calls to this advance it). No-op when idle."""
    active = active_capture()
    if active is not None:
        active.advance_step(manual=True)


__all__ = ["capture", "dump", "step", "warmup", "graph_rows", "graph_replayed", "Capture", "active_capture"]
