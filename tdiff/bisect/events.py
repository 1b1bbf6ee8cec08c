"""The recorded events of one process, in execution order, and how they nest.

An event is one paired tensor: a module's input (recorded before it runs), its output (after),
or an explicit dump. Records carry the module path, the enclosing call's path (``parent``) and
the nesting depth, which is enough to answer the questions bisect asks:

- which event came last at the same level of the enclosing forward (:func:`previous_at_level`);
- which event of a module's children came last before its output (:func:`last_child_event`);
- where the enclosing calls ended (:func:`enclosing_outputs`).

Example stream (depth, role, module)::

    2 input   model.layers.1                          the layer's own input
    3 input   model.layers.1.input_layernorm
    ...
    4 output  model.layers.1.self_attn.o_proj          inside self_attn: skipped at depth 3
    3 output  model.layers.1.self_attn                the last event at depth 3 before ...
    3 input   model.layers.1.post_attention_layernorm  ... this one: the code between them is
                                                       model.layers.1's own
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tdiff.compare.pairing import Pair
from tdiff.store import Record


@dataclass(frozen=True)
class Stream:
    """The pairs of one process (rank and manifest part of side A), in A's execution order."""

    key: tuple
    pairs: list[Pair]

    def record(self, index: int) -> Record:
        return self.pairs[index].record


def split_streams(pairs: list[Pair]) -> list[Stream]:
    """Group pairs by the process that recorded them: nesting is only meaningful within one.

    A pair seen on side B only joins the stream of the pair before it.
    """
    streams: dict[tuple, list[Pair]] = defaultdict(list)
    key = None
    for pair in pairs:
        if pair.a is not None:
            key = (pair.a.record.rank, pair.a.record.part)
        elif key is None or key[0] != pair.b.record.rank:
            key = (pair.b.record.rank, "")
        streams[key].append(pair)
    return [Stream(k, v) for k, v in streams.items()]


def parent_of(record: Record) -> str | None:
    """The path of the call enclosing this event; "" is the outermost model, None the top level.

    Manifests leave out an empty parent, so a record below the outermost model has parent None
    but a depth above zero.
    """
    if record.parent is not None:
        return record.parent
    return "" if record.depth > 0 else None


def same_call(a: Record, b: Record) -> bool:
    return (a.module, a.step, a.call, a.depth) == (b.module, b.step, b.call, b.depth) and a.role != "explicit"


def previous_at_level(stream: Stream, index: int) -> int | None:
    """The last event before ``index`` in the same forward: a sibling module's output (or input),
    an explicit dump there, or the enclosing module's own input. None when the enclosing call's
    start is not recorded (its module was not captured, or has no tensor inputs and no sibling
    event came first)."""
    event = stream.record(index)
    parent, depth = parent_of(event), event.depth
    for j in range(index - 1, -1, -1):
        other = stream.record(j)
        if other.depth == depth and parent_of(other) == parent:
            if event.role == "input" and other.role == "input" and same_call(other, event):
                continue  # an earlier input of the same call
            return j
        if other.depth == depth - 1 and other.module == parent and other.role == "input":
            return j
        if other.depth < depth:
            return None
    return None


def last_child_event(stream: Stream, index: int) -> int | None:
    """For a module's output at ``index``: the last event of its children (or of an explicit dump
    inside it) in the same call, or None when nothing below it was recorded."""
    output = stream.record(index)
    for j in range(index - 1, -1, -1):
        other = stream.record(j)
        if other.role == "output" and same_call(other, output):
            continue  # an earlier output tensor of the same call
        if other.depth == output.depth + 1 and parent_of(other) == output.module:
            return j
        if other.depth <= output.depth:
            return None
    return None


def enclosing_outputs(stream: Stream, index: int, module: str | None, depth: int) -> list[list[int]]:
    """The output events of the calls enclosing an event at ``index``, innermost first.

    ``module`` is the path of the innermost enclosing call and ``depth`` its depth. Each entry
    lists that call's output events (a module may return several tensors). The walk stops at the
    first enclosing call whose output was not recorded.
    """
    found = []
    while module is not None:
        outputs = []
        for j in range(index + 1, len(stream.pairs)):
            other = stream.record(j)
            if other.depth > depth:
                continue  # still inside the call
            if other.role == "output" and other.module == module and other.depth == depth:
                outputs.append(j)
                continue
            break
        if not outputs:
            break
        found.append(outputs)
        index = outputs[-1]
        module = parent_of(stream.record(index))
        depth -= 1
    return found
