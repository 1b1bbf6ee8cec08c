"""Each framework's capture knowledge, one module a framework: what only the running process
knows about that framework's modules and calls.

A framework's module names the top-level package of its classes (``FRAMEWORK``) and gives what
applies to it of:

- ``annotate(module, path, role, sub, tensor) -> dict | None``: its records' parallel coordinates
  and shard specs (tdiff.hooks.annotations);
- ``tokens(module, args, kwargs) -> dict | None``: the tokens of an outermost model call, as the
  arguments of :func:`tdiff.hooks.tokens.describe_tokens` (tdiff.hooks.tokens);
- ``GRAPH_RUNNERS``: ``(module name, hook)`` pairs, a hook run when the program imports the module
  of a runner that replays CUDA graphs without ``CUDAGraph.replay`` (tdiff.hooks.cuda_graphs).

None imports its framework: a class is looked up only in a module the program has imported.
A new framework is its module here and its line in ``FRAMEWORKS`` (and, to align its runs with
another framework's, its adapter in tdiff/align/adapters/).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tdiff.hooks.frameworks import hf, megatron, sglang

FRAMEWORKS = (hf, megatron, sglang)

ANNOTATORS: dict[str, Callable[..., dict | None]] = {
    f.FRAMEWORK: f.annotate for f in FRAMEWORKS if getattr(f, "annotate", None) is not None}
TOKEN_SOURCES: dict[str, Callable[[Any, tuple, dict], dict | None]] = {
    f.FRAMEWORK: f.tokens for f in FRAMEWORKS if getattr(f, "tokens", None) is not None}
GRAPH_RUNNERS: tuple[tuple[str, Callable[[Any], None]], ...] = tuple(
    runner for f in FRAMEWORKS for runner in getattr(f, "GRAPH_RUNNERS", ()))
