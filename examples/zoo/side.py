"""One side of a zoo class: the tiny model scoring a sequence, the trainer's way or with the
engine's planted variant.

    python -m examples.zoo.side CLASS trainer
    python -m examples.zoo.side CLASS engine

Run under `tdiff capture`; the model's modules are recorded, and the log-prob of every token
(but the first) is dumped as ``logprobs``. The engine of a class with ``engine_batch`` 2 scores
the sequence in a batch with another one (capture it with --batch-row 0); a class with ``ranks``
2 runs under torchrun, gloo (``python -m torch.distributed.run --standalone --nproc-per-node 2 -m
examples.zoo.side CLASS SIDE``).
"""

from __future__ import annotations

import argparse
import re

import torch

import tdiff
from examples.zoo.classes import CLASSES, Plant, by_key
from examples.zoo.model import VOCAB, build, megatron_core_attention

TOKENS = 16


def plant(model: torch.nn.Module, plants: tuple[Plant, ...]) -> None:
    for p in plants:
        matched = [module for path, module in model.named_modules() if re.fullmatch(p.module, path)]
        if not matched:
            raise SystemExit(f"zoo: no module matches {p.module!r}")
        value = getattr(torch, str(p.value)) if p.attribute.endswith("dtype") else p.value
        for module in matched:
            if not hasattr(module, p.attribute):
                raise SystemExit(f"zoo: a {type(module).__name__} has no variant {p.attribute!r}")
            setattr(module, p.attribute, value)


def sequences(count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (count, TOKENS), generator=generator)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("zoo_class", choices=[c.key for c in CLASSES])
    parser.add_argument("side", choices=["trainer", "engine"])
    args = parser.parse_args(argv)
    zoo_class = by_key(args.zoo_class)
    torch.set_num_threads(1)
    if zoo_class.ranks > 1:   # started by torchrun: each rank scores the same sequence
        torch.distributed.init_process_group("gloo")
    model = build()
    plant(model, zoo_class.both)
    if args.side == "trainer" and zoo_class.megatron_attention:
        for number, attention in enumerate(model.model.layers):
            attention.get_submodule("self_attn").attn = megatron_core_attention(number)
    if args.side == "engine":
        plant(model, zoo_class.engine)
    input_ids = sequences(zoo_class.engine_batch if args.side == "engine" else 1)
    with torch.no_grad():
        logprobs = model(input_ids)
    tdiff.dump("logprobs", logprobs[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0])
    if zoo_class.ranks > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
