"""Graft: run one module call on another run's recorded inputs.

``tdiff bisect --graft`` reruns side B with a capture whose ``graft`` option names a call of a
module and the dump of side A. When B reaches that call, each input tensor is replaced by A's
recorded input of the same sub-name (``0``, ``hidden_states``, ``position_embeddings.1``); the
capture then records B's output of that call as usual. Comparing it with A's output tells "the op
differs on identical inputs" from "only its inputs differed".

Input names must agree: two runs of the same program do. Runs of different frameworks lay their
inputs out differently; turning A's inputs into B's layout is the job of cross-framework alignment
(tdiff.align), and a name that does not match is an error here, never a silent partial graft.

Example of the capture option (as ``tdiff.bisect`` writes it)::

    {"dump": "runs/a-final", "module": "model.layers.1.mlp", "module_b": "model.layers.1.mlp",
     "step": 0, "call": 0}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tdiff.errors import TdiffError
from tdiff.hooks.naming import replace_call_inputs

if TYPE_CHECKING:
    from tdiff.store import Dump


class InputGraft:
    """Replaces the inputs of the call (``module_b``, ``step``, ``call``) with the inputs that
    ``module`` had at the same step and call in ``dump``, rank by rank."""

    def __init__(self, *, dump: str, module: str, module_b: str, step: int, call: int):
        self.dump_path = dump
        self.module = module
        self.module_b = module_b
        self.step = step
        self.call = call
        self._dump: Dump | None = None

    def inputs(self, path: str, step: int, call: int, rank: int, args: tuple, kwargs: dict):
        if (path, step, call) != (self.module_b, self.step, self.call):
            return args, kwargs
        grafted = self._recorded_inputs(rank)
        used: set[str] = set()

        def take(name: str, tensor: torch.Tensor) -> torch.Tensor:
            if name not in grafted:
                return tensor
            used.add(name)
            return _like(grafted[name], tensor, name)

        args, kwargs = replace_call_inputs(args, kwargs, take)
        unused = sorted(set(grafted) - used)
        if unused:
            raise TdiffError(f"graft: `{path}` has no input named {unused[0]!r} as side A's "
                             f"`{self.module}` had; grafting across layouts needs an alignment plan")
        return args, kwargs

    def _recorded_inputs(self, rank: int) -> dict[str, torch.Tensor]:
        from tdiff.store.reader import open_dump

        if self._dump is None:
            self._dump = open_dump(self.dump_path)
        dump = self._dump
        records = [r for r in dump.records
                   if r.role == "input" and r.module == self.module and r.step == self.step
                   and r.call == self.call and r.rank == rank]
        if not records:
            raise TdiffError(f"graft: {self.dump_path} holds no inputs of `{self.module}` at step "
                             f"{self.step} call {self.call} rank {rank}")
        return {r.sub: dump.load(r) for r in records}


def _like(source: torch.Tensor, target: torch.Tensor, name: str) -> torch.Tensor:
    """Side A's tensor where side B's was: same dtype and shape required, B's device kept."""
    if source.dtype != target.dtype or source.shape != target.shape:
        raise TdiffError(f"graft: input {name!r} is {source.dtype} {list(source.shape)} on side A but "
                         f"{target.dtype} {list(target.shape)} on side B; grafting across layouts "
                         "needs an alignment plan")
    grafted = source.to(target.device)
    if target.requires_grad and grafted.is_floating_point():
        grafted.requires_grad_(True)
    return grafted
