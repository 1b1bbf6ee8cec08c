"""Synthetic runs of the same sequences in any token layout, written through the real capture API
(tdiff.tokens, tdiff.dump): an engine's prefill (whole or chunked) and decode steps over ragged
batches, a trainer's packed (THD) or padded forward, in any order.

A token's row is what a causal model computes for it: a function of the sequence's tokens up to
and including it, so two honest runs give it the same row whatever their layout, and n samples of
one prompt share their prompt's rows."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

import tdiff

WIDTH = 3


def row(tokens: list[int], position: int) -> list[float]:
    prefix = zlib.crc32(bytes(str(tokens[:position + 1]), "ascii"))
    return [float(prefix % 1000) / 8, float(position), float(tokens[position])]


@dataclass
class Forward:
    """One forward: per sequence of it (its key in ``sequences``), the positions it feeds."""

    feeds: list[tuple[str, list[int]]]
    padded: bool = False     # a [batch, seq] grid, each sequence's tokens at its row's start
    padding: int = 0         # cells of padding after the tokens (ragged) or per row (padded)
    ids: bool = True         # the request ids given


@dataclass
class Run:
    sequences: dict[str, list[int]]
    forwards: list[Forward]
    # added to a token's row: (sequence, position) -> in every forward; (forward, sequence, position) -> in one
    planted: dict[tuple, float] = field(default_factory=dict)
    no_tokens: set[int] = field(default_factory=set)                      # forwards described by nobody


def capture_run(path, run: Run) -> None:
    with tdiff.capture(path):
        record_run(run)


def record_run(run: Run) -> None:
    """The run's forwards, into the active capture (tdiff.capture, or `tdiff capture -- python -m
    tests.align.token_layouts ...`)."""
    for k, forward in enumerate(run.forwards):
        tdiff.step()
        ids, positions, values = _grid(run, forward, k)
        if k not in run.no_tokens:
            lens = [len(ps) for _, ps in forward.feeds]
            tdiff.tokens(input_ids=ids, positions=positions, seq_lens=lens,
                         seq_ids=[key.split("#")[0] for key, _ in forward.feeds] if forward.ids else None)
        tdiff.dump("hidden", values, layout="batch-first")   # a square padded grid needs it said


def _grid(run: Run, forward: Forward, k: int):
    def cells(key: str, positions: list[int]):
        tokens = run.sequences[key]

        def planted(p):
            return run.planted.get((key, p), 0.0) + run.planted.get((k, key, p), 0.0)

        return ([tokens[p] for p in positions], positions,
                [[v + (planted(p) if i == 0 else 0.0) for i, v in enumerate(row(tokens, p))] for p in positions])

    parts = [cells(key, positions) for key, positions in forward.feeds]
    if forward.padded:
        width = max(len(p[0]) for p in parts) + forward.padding
        ids = [p[0] + [0] * (width - len(p[0])) for p in parts]
        positions = [p[1] + [0] * (width - len(p[1])) for p in parts]
        values = [p[2] + [[0.0] * WIDTH] * (width - len(p[2])) for p in parts]
        return torch.tensor(ids), torch.tensor(positions), torch.tensor(values)
    ids = [t for p in parts for t in p[0]] + [0] * forward.padding
    positions = [q for p in parts for q in p[1]] + [0] * forward.padding
    values = [v for p in parts for v in p[2]] + [[0.0] * WIDTH] * forward.padding
    return torch.tensor(ids), torch.tensor(positions), torch.tensor(values)


def engine(sequences: dict[str, list[int]], prompt_lens: dict[str, int], order=None, **run) -> Run:
    """A prefill of every prompt, then one decode step per response token but the last."""
    order = order or list(sequences)
    forwards = [Forward([(key, list(range(prompt_lens[key]))) for key in order], padding=1)]
    longest = max(len(sequences[k]) - prompt_lens[k] for k in order)
    for k in range(longest - 1):
        feeds = [(key, [prompt_lens[key] + k]) for key in order if prompt_lens[key] + k < len(sequences[key]) - 1]
        if feeds:
            forwards.append(Forward(feeds, padding=1))
    return Run(sequences, forwards, **run)


def trainer(sequences: dict[str, list[int]], order=None, *, padded=False, **run) -> Run:
    """One forward over the finished sequences, packed or padded."""
    order = order or list(sequences)
    return Run(sequences, [Forward([(key, list(range(len(sequences[key])))) for key in order], padded=padded,
                                   padding=1 if padded else 0)], **run)


# the runs a program run under `tdiff capture` (bisect --run-a, patch try) records
SEQUENCES = {"r1": [5, 6, 7, 8, 9, 10], "r2": [5, 11, 12, 13, 14]}
PROMPTS = {"r1": 3, "r2": 2}


def main(argv: list[str] | None = None) -> None:
    """python -m tests.align.token_layouts trainer|engine [--no-tokens K] [--planted SEQ:POS]:
    SEQUENCES scored by a trainer (one packed forward, reordered) or rolled out by an engine
    (prefill, decode steps); forward K described by no token metadata; 1.0 added to a token's row."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("layout", choices=["trainer", "engine"])
    parser.add_argument("--no-tokens", type=int, action="append", default=[])
    parser.add_argument("--planted", action="append", default=[])
    args = parser.parse_args(argv)
    planted = {(key, int(position)): 1.0 for key, _, position in (p.partition(":") for p in args.planted)}
    run = (trainer(SEQUENCES, ["r2", "r1"], planted=planted) if args.layout == "trainer"
           else engine(SEQUENCES, PROMPTS, no_tokens=set(args.no_tokens), planted=planted))
    record_run(run)


if __name__ == "__main__":
    main()
