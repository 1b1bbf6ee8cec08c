"""Token metadata at capture: what ``tdiff.tokens`` is given, and what a framework's outermost
model call says by itself (its token source).

A token source is registered per framework (the top-level package of the outermost module's
class): ``register_token_source("transformers", source)``; ``source(module, args, kwargs)``
returns the keyword arguments of :func:`describe_tokens` for that call, or None when the call
carries no token ids. Those of Hugging Face, SGLang and megatron-core are built in
(tdiff/hooks/frameworks/); other frameworks register theirs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tdiff.errors import TdiffError
from tdiff.hooks.frameworks import TOKEN_SOURCES
from tdiff.hooks.device import completion_event
from tdiff.store.tokens import PADDING, DeferredTokens, RowTokens, TokenBatch

if TYPE_CHECKING:
    from tdiff.hooks.capture import Capture

TokenSource = Callable[[Any, tuple, dict], "dict | None"]
_SOURCES: dict[str, TokenSource] = dict(TOKEN_SOURCES)


def register_token_source(framework: str, source: TokenSource) -> None:
    _SOURCES[framework] = source


def token_source(framework: str | None) -> TokenSource | None:
    return _SOURCES.get(framework) if framework else None


class TokenRecorder:
    """The token metadata of one capture in this process: what ``tdiff.tokens`` was given (held
    until the forward it describes runs) and what each outermost model call says by itself."""

    def __init__(self, capture: Capture):
        self._capture = capture
        self.pending: TokenBatch | None = None   # tdiff.tokens() given before its forward ran
        self._step: int | None = None            # the last step whose tokens were recorded

    def given(self, given: dict) -> None:
        """``tdiff.tokens``: inside a model call they describe the forward running; else the next
        outermost call's, or the current step's when an explicit dump or the capture's end comes
        first in a step no model ran in (values computed without a model). Checked at once."""
        thread = self._capture.running.thread()
        batch = describe_tokens(step=thread.step, rank=0, **given)
        if thread.stack:
            self.write(batch)
        else:
            self.pending = batch

    def write_pending(self) -> None:
        """The tokens given describe the current step (no model call read them: a CUDA graph's
        replay, an explicit dump in a step no model ran in, the capture's end)."""
        if self.pending is not None:
            self.write(self.pending)

    def of_forward(self, module, args: tuple, kwargs: dict) -> None:
        """At an outermost call: the tokens given for it, else what its framework's source reads
        from the call (once per step), described by the writer from copies taken now."""
        batch, self.pending = self.pending, None
        step = self._capture.running.thread().step
        if batch is not None:
            self.write(batch)
        elif self._step != step:
            framework = type(getattr(module, "_orig_mod", module)).__module__.partition(".")[0]
            source = token_source(framework)
            given = source(module, args, kwargs) if source is not None else None
            if given is not None and self._wanted(step):
                self._step = step
                copies, ready = _snapshot(given)
                rank = self._capture.running.rank()
                self._capture.writer.submit_tokens(DeferredTokens(
                    step, functools.partial(describe_tokens, step=step, rank=rank, source=framework, **copies), ready))

    def write(self, batch: TokenBatch) -> None:
        self.pending = None
        step = self._capture.running.thread().step
        if self._wanted(step):
            self._step = step
            capture = self._capture
            capture.writer.submit_tokens(dataclasses.replace(batch, step=step, rank=capture.running.rank()))

    def _wanted(self, step: int) -> bool:
        capture = self._capture
        if capture.options.batch_row is not None:
            capture.note("--batch-row: token metadata is not recorded (rows are cut from the batch)")
            return False
        return capture.selection.wants_step(step) and not capture.part.failed


def _snapshot(given: dict) -> tuple[dict, tuple]:
    """Copies of what a token source read from a call, taken now (the program may reuse its
    buffers once the forward ran), and the events that say a device's copies have arrived: those
    go to pinned host memory in their stream's order, without waiting (a synchronising copy here
    stopped the host at every forward: 0.5-1 ms on the H100 host, and an engine's run-ahead)."""
    copies, devices = {}, set()
    for key, value in given.items():
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.is_cuda:
                devices.add(value.device)
                value = value.to("cpu", non_blocking=True)
            else:
                value = value.clone()
        elif isinstance(value, (list, tuple)):
            value = list(value)
        copies[key] = value
    ready = []
    for device in devices:
        event = completion_event()
        event.record(torch.cuda.current_stream(device))
        ready.append(event)
    return copies, tuple(ready)


def describe_tokens(*, step: int, rank: int, input_ids, positions=None, seq_lens=None, seq_ids=None,
                    prompt_lens=None, mask=None, source: str = "tokens") -> TokenBatch:
    """A forward's :class:`TokenBatch` from tensors (or lists).

    ``input_ids``: ``[batch, seq]`` (row b is sequence b) or ``[tokens]`` (ragged or packed: the
    sequences one after another, ``seq_lens`` tokens each; cells past their sum are padding).
    ``positions``: same shape, 0-based from each sequence's start (default: counted from 0 in each
    sequence). ``seq_lens`` for a 2-D grid: real tokens at the start of each row (right padding).
    ``mask``: same shape, true for real tokens (drops padding anywhere, left padding included).
    ``seq_ids``: one request id per sequence; ``prompt_lens``: each sequence's prompt length.

    This runs at every forward a capture sees, with nothing selected too: the arithmetic is
    numpy's on one thread (torch's small CPU ops woke its teams of threads: 6 ms a forward of
    8 x 512 tokens on a 16-core host).
    """
    ids = _long(input_ids, "input_ids")
    if ids.ndim not in (1, 2):
        raise TdiffError(f"tdiff.tokens: input_ids must be [tokens] or [batch, seq], not {list(ids.shape)}")
    grid = ids.shape
    lens = _long(seq_lens, "seq_lens").ravel() if seq_lens is not None else None
    if ids.ndim == 2:
        batch, width = grid
        seqs = np.repeat(np.arange(batch, dtype=np.int64)[:, None], width, axis=1)
        if lens is not None:
            _check_lens(lens, batch, "one length per row of input_ids")
            seqs[np.arange(width)[None, :] >= lens[:, None]] = PADDING
        sequences = batch
    else:
        if lens is None:
            lens = np.array([grid[0]], dtype=np.int64)
        _check_lens(lens, None, "")
        real_tokens = int(lens.sum())
        if real_tokens > grid[0]:
            raise TdiffError(f"tdiff.tokens: seq_lens add up to {real_tokens}, more than the {grid[0]} "
                             "tokens of input_ids")
        seqs = np.full(grid, PADDING, dtype=np.int64)
        seqs[:real_tokens] = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
        sequences = len(lens)
    if mask is not None:
        real = torch.as_tensor(mask).to(torch.bool).cpu().numpy()
        if real.shape != grid:
            raise TdiffError(f"tdiff.tokens: mask {list(real.shape)} must have input_ids' shape {list(grid)}")
        seqs[~real] = PADDING
    if positions is None:
        pos = _count_positions(seqs)
    else:
        pos = _long(positions, "positions")
        if pos.ndim == 2 and pos.shape[0] == 1 and len(grid) == 2:
            pos = np.broadcast_to(pos, (grid[0], pos.shape[1]))   # [1, seq] positions shared by the batch (Hugging Face)
        if pos.shape != grid:
            raise TdiffError(f"tdiff.tokens: positions {list(pos.shape)} must have input_ids' shape {list(grid)}")
    return TokenBatch(step=step, rank=rank, shape=grid, input_ids=ids.ravel().tolist(),
                      positions=pos.ravel().tolist(), seqs=seqs.ravel().tolist(), sequences=sequences,
                      seq_ids=_per_sequence(seq_ids, "seq_ids", sequences),
                      prompt_lens=_per_sequence(prompt_lens, "prompt_lens", sequences), source=source)


def _per_sequence(value, what: str, sequences: int) -> list | None:
    if value is None:
        return None
    values = value.flatten().tolist() if isinstance(value, torch.Tensor) else list(value)
    if len(values) != sequences:
        raise TdiffError(f"tdiff.tokens: {what} gives {len(values)} values for {sequences} sequences")
    return values


def row_tokens(value_shape: tuple[int, ...], positions, seq_ids) -> RowTokens:
    """What ``tdiff.dump(name, value, positions=P, seq_ids=S)`` stores: P over value's leading
    dims; S (same shape) the sequence of each row in the forward just run, else the batch row:
    the row index of a 2-D P, the element index of a 1-D one."""
    pos = _long(positions, "positions")
    if pos.ndim == 0 or tuple(value_shape[:pos.ndim]) != pos.shape:
        raise TdiffError(f"tdiff.dump: positions {list(pos.shape)} must match the leading dims of the value "
                         f"{list(value_shape)}")
    if seq_ids is not None:
        seqs = _long(seq_ids, "seq_ids")
        if seqs.shape != pos.shape:
            raise TdiffError(f"tdiff.dump: seq_ids {list(seqs.shape)} must have the shape of positions "
                             f"{list(pos.shape)}")
    else:
        seqs = np.broadcast_to(np.arange(pos.shape[0]).reshape(-1, *([1] * (pos.ndim - 1))), pos.shape)
    return RowTokens(pos.shape, pos.ravel().tolist(), seqs.ravel().tolist())


def _long(value, what: str) -> np.ndarray:
    tensor = torch.as_tensor(value).detach().cpu()
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TdiffError(f"tdiff.tokens: {what} must hold integers, not {tensor.dtype}")
    return tensor.to(torch.long).numpy()


def _check_lens(lens: np.ndarray, count: int | None, what: str) -> None:
    if count is not None and len(lens) != count:
        raise TdiffError(f"tdiff.tokens: seq_lens must give {what} ({count}), not {len(lens)}")
    if bool((lens < 0).any()):
        raise TdiffError("tdiff.tokens: seq_lens must not be negative")


def _count_positions(seqs: np.ndarray) -> np.ndarray:
    """Positions counted from 0 along each sequence's cells, row-major (padding: 0)."""
    flat = seqs.ravel()
    order = np.argsort(flat, kind="stable")
    grouped = flat[order]
    index = np.arange(len(flat))
    starts = np.ones(len(flat), dtype=bool)
    starts[1:] = grouped[1:] != grouped[:-1]
    first = np.maximum.accumulate(np.where(starts, index, 0))
    positions = np.empty_like(flat)
    positions[order] = index - first
    positions[flat == PADDING] = 0
    return positions.reshape(seqs.shape)
