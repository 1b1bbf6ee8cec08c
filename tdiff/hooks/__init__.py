"""Capture: module hooks and explicit dumps that write a tdiff dump."""

from __future__ import annotations

import dataclasses
import inspect

import torch

from tdiff.capture_options import CaptureOptions, options_doc
from tdiff.hooks.active import active_capture
from tdiff.hooks.capture import Capture
from tdiff.hooks.cuda_graphs import graph_replayed, graph_rows, warmup


def capture(out_dir, *, model=None, graft=None, **options) -> Capture:
    """Record module inputs and outputs into ``out_dir`` while the ``with`` block runs.

    Args:
        out_dir: the dump directory (created; the processes of one run share it: a program's
            torchrun ranks and multiprocessing workers, the processes it starts while capturing).
            Another capture writing there at the same time (a second program, `tdiff capture`) is
            refused, as is an earlier run's dump that holds records, unless ``force=True``.
        model: the outermost model; names are taken from it and its ``forward`` is wrapped too.
        graft: bisect --graft's (tdiff.hooks.graft): the call whose inputs are another run's.
        options: the capture's options (:class:`tdiff.capture_options.CaptureOptions`), listed
            below as `tdiff capture` has them. In Python, ``select``, ``exclude`` and ``ops`` take
            a regex or a list of them, ``layers`` and ``steps`` ranges like "0-3,7", an int or a
            list of ints, and sizes are bytes. A ``select`` or ``layers`` that matches no module is
            said at the capture's end (a warning, and a note in the dump), with the number of
            explicit dumps recorded. With ``ops``, each op's record also names the Python
            function and source line that ran it and its inputs' records (tdiff.hooks.ops). With
            ``params`` or without, every recorded module's class and scalar settings (eps, RoPE
            theta...) are described.

    Options:
    """
    return Capture(out_dir, CaptureOptions(**options), model=model, graft=graft)


def _declare_options(function) -> None:
    """``function`` (which takes ``**options``) names each capture option in its signature and
    docstring, with its default, as CaptureOptions declares it."""
    signature = inspect.signature(function)
    named = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    options = [inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=option.default)
               for option in dataclasses.fields(CaptureOptions)]
    function.__signature__ = signature.replace(parameters=[*named, *options])
    if function.__doc__:   # (python -OO drops docstrings)
        function.__doc__ = f"{function.__doc__.rstrip(' ')}{options_doc(indent=' ' * 8)}\n    "


_declare_options(capture)


def dump(name: str, value, *, positions=None, seq_ids=None, layout=None):
    """Record ``value`` (a tensor or a nested structure of them) under ``name``; returns ``value``.

    ``positions`` (an integer tensor over the value's leading token dims) gives the position each
    row stands for, 0-based from the start of its sequence (for a log-prob: the position of the
    token it scores); ``seq_ids`` (same shape) the index of each row's sequence in the forward just
    run, by default the row of a 2-D ``positions`` (the element of a 1-D one). With them the rows
    align by token against the other run (docs/ALIGNMENT.md). ``layout`` (``"batch-first"`` or
    ``"seq-first"``) says how a value shaped like its forward's token grid lays the grid out, where
    the shape alone cannot tell (a square batch: as many sequences as tokens in each).

    A no-op when no capture is active, so the call can stay in user code, and inside code that
    torch.compile compiles (which then compiles as if the call were not there).
    """
    if torch.compiler.is_compiling():
        return value
    active = active_capture()
    if active is not None:
        active.dump(name, value, positions=positions, seq_ids=seq_ids, layout=layout)
    return value


def tokens(*, input_ids, positions=None, seq_lens=None, seq_ids=None, prompt_lens=None, mask=None) -> None:
    """Describe the tokens of a forward: called before it, the next outermost model call's;
    called inside it, the running one's. Replaces what capture reads from the model call itself.

    Args:
        input_ids: ``[batch, seq]`` (row b is sequence b) or ``[tokens]`` (sequences one after
            another, ragged or packed).
        positions: same shape: each token's position, 0-based from its sequence's start
            (default: counted from 0 in each sequence of this forward).
        seq_lens: tokens each sequence has in this forward (a 1-D grid: cells past their sum are
            padding; a 2-D one: real tokens at the start of each row).
        seq_ids: one request id per sequence (text or integer), to tell apart sequences whose
            tokens are the same (n samples of one prompt) and to follow them across steps.
        prompt_lens: each sequence's prompt length, where no decode step tells prompt from
            response (a prefill recompute of finished sequences).
        mask: same shape as input_ids, true for real tokens (padding anywhere is dropped).
    """
    if torch.compiler.is_compiling():
        return
    active = active_capture()
    if active is not None:
        active.tokens(input_ids=input_ids, positions=positions, seq_lens=seq_lens, seq_ids=seq_ids,
                      prompt_lens=prompt_lens, mask=mask)


def step() -> None:
    """Advance the step index (from then on, only calls to this advance it). No-op when idle."""
    active = active_capture()
    if active is not None:
        active.advance_step(manual=True)


__all__ = ["capture", "dump", "tokens", "step", "warmup", "graph_rows", "graph_replayed", "Capture", "active_capture"]
