"""Small programs that tests run under `tdiff capture` / `tdiff bisect` as real subprocesses.

    python -m tests.bisect.programs repeat COUNTER --nondeterministic-run K
    python -m tests.bisect.programs amplify [--split-k]
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from pathlib import Path

import torch

import tdiff
from tests.bisect import planted
from tests.helpers import tiny_qwen2, token_ids


def repeat(counter: Path, nondeterministic_run: int) -> None:
    """A tiny Qwen2 scoring one sequence; run number K (counted in COUNTER) reduces
    model.layers.0.mlp.down_proj in another order, like a nondeterministic kernel would."""
    run = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(run))
    model = tiny_qwen2()
    if run == nondeterministic_run:
        planted.split_k_linear(model.model.layers[0].mlp.down_proj)
    with torch.no_grad():
        logits = model(token_ids()).logits
    tdiff.dump("logprobs", torch.log_softmax(logits, -1))


class Amplify(torch.nn.Module):
    def forward(self, x):
        return x * 1e4


def amplify(split_k: bool) -> None:
    """proj -> amplify (x 1e4) -> head. With --split-k, proj reduces in another order: a difference
    far below 1e-5 that ``amplify`` scales past it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(proj=torch.nn.Linear(64, 64), amplify=Amplify(),
                                            head=torch.nn.Linear(64, 4)))
    if split_k:
        planted.split_k_linear(model.proj)
    with torch.no_grad():
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(1)))


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="program", required=True)
    rep = sub.add_parser("repeat")
    rep.add_argument("counter", type=Path)
    rep.add_argument("--nondeterministic-run", type=int, default=0)
    amp = sub.add_parser("amplify")
    amp.add_argument("--split-k", action="store_true")
    args = parser.parse_args()
    if args.program == "repeat":
        repeat(args.counter, args.nondeterministic_run)
    else:
        amplify(args.split_k)


if __name__ == "__main__":
    main()
