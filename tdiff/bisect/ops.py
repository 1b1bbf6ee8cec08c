"""Bisect descends into a module's own code: the op that introduced the divergence.

When the culprit is a module's own code (event "between", or a module whose inputs match and
whose output differs) and both dumps hold op records of that call (``tdiff capture --ops``), the
ops of the call are walked in order on both sides:

- the first op whose output differs, where every op before it matched (its inputs, earlier op
  outputs and the call's recorded inputs, match too): that op made the difference;
- or the first position where the two op sequences part (a cast added, an op swapped, a fused
  kernel on one side): both sides' ops are named.

``first_divergence.op`` is then ``{"name": "aten::mul.Tensor", "index": 8, "function":
"apply_rotary_pos_emb", "source": "modeling_qwen2.py:125", "name_b": ..., "function_b": ...,
"source_b": ..., "index_b": 8, "parted": false}`` and the kind is read from the op and its
function (tdiff.vocab.kinds.op_kind). Without op records, a note gives the capture command that
would record them.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from itertools import groupby

from tdiff.bisect.result import Divergence
from tdiff.bisect.verdict import EventComparator
from tdiff.compare.engine import Comparison
from tdiff.compare.pairing import Pair, Side
from tdiff.store import Dump, Record
from tdiff.vocab.kinds import op_kind
from tdiff.vocab.paths import ROOT_LABEL


@dataclass
class OpDivergence:
    """The op of the culprit's call where the two runs part."""

    a: Record | None      # side A's op (its first output record); None where A's ops ended first
    b: Record | None
    comparison: Comparison | None   # the op's output verdict; None where the sequences part
    module: str | None = None

    @property
    def parted(self) -> bool:
        return self.comparison is None

    def to_json(self) -> dict:
        a, b = (_op_fields(r) for r in (self.a, self.b))
        return {"name": a.get("name"), "index": a.get("index"), "function": a.get("function"),
                "source": a.get("source"), "name_b": b.get("name"), "index_b": b.get("index"),
                "function_b": b.get("function"), "source_b": b.get("source"), "parted": self.parted}

    def describe(self) -> str:
        if not self.parted:
            return (f"op {_op(self.a)}: its inputs match, its output differs")
        return f"the op sequences part at op {_op(self.a)} on side A and op {_op(self.b)} on side B"


def _op_fields(record: Record | None) -> dict:
    """An op record's ``op`` (name, index, function, source, inputs); {} for no record."""
    return (record.op or {}) if record is not None else {}


def _op(record: Record | None) -> str:
    if record is None:
        return "(none: its ops ended)"
    op = _op_fields(record)
    where = f"{op['function']} ({op['source']})" if op.get("function") else "an unknown caller"
    return f"#{op['index']} {op['name']} in {where}"


def descend(a: Dump, b: Dump, divergence: Divergence, comparator: EventComparator) -> list[str]:
    """Name the op inside the culprit's call (``divergence.op``, and its kind); returns notes."""
    if not own_code(divergence):
        return []
    record = divergence.comparison.record
    call = record.call if divergence.event == "output" else divergence.module_call
    ops_a = _call_ops(a, divergence.module, record.step, call, record.rank)
    ops_b = _call_ops(b, divergence.module_b, record.step, call, record.rank)
    if not ops_a and not ops_b:
        return [zoom_hint(a, b, divergence.module)]
    if not ops_a or not ops_b:
        side = "A" if not ops_a else "B"
        return [(f"side {side} has no op records of `{path_label(divergence.module)}`: capture both sides with the "
                 "same --ops to name the op")]
    # what capture said about how it recorded ops (a compiled module run eagerly, a CUDA graph)
    limits = [f"side {label}: {note}" for label, dump in (("A", a), ("B", b))
              for note in dump.notes if note.startswith("--ops:")]
    found = _first_op(ops_a, ops_b, comparator)
    if found is None:
        return [*limits, (f"the ops recorded in `{path_label(divergence.module)}` match on both sides: the difference "
                          "enters through what no op record holds (a parameter, a tensor made outside the call, a "
                          "kernel that bypasses the dispatcher or a CUDA graph replay)")]
    found.module = divergence.module
    attach(divergence, found)
    return limits


def attach(divergence: Divergence, op: OpDivergence) -> None:
    """Name ``op`` as the divergence's op; its kind, where the op and its function say one."""
    divergence.op = op
    named = _op_fields(op.a or op.b)
    divergence.kind = op_kind(named["name"], named["function"], divergence.kind) or divergence.kind


def own_code(divergence: Divergence) -> bool:
    """Whether the culprit is a module's own code, which op records can zoom into."""
    return divergence.introduced and divergence.module is not None and divergence.event in ("output", "between")


def _call_ops(dump: Dump, module: str | None, step: int, call: int | None, rank: int) -> list[list[Record]]:
    """The call's op records, grouped by op (an op with several tensor outputs has several)."""
    if module is None or call is None:
        return []
    records = [r for r in dump.ops
               if r.module == module and r.step == step and r.call == call and r.rank == rank]
    return [list(group) for _, group in groupby(records, key=lambda r: _op_fields(r)["index"])]


def _first_op(ops_a: list[list[Record]], ops_b: list[list[Record]],
              comparator: EventComparator) -> OpDivergence | None:
    for position in range(max(len(ops_a), len(ops_b))):
        op_a = ops_a[position] if position < len(ops_a) else None
        op_b = ops_b[position] if position < len(ops_b) else None
        if op_a is None or op_b is None or _op_fields(op_a[0])["name"] != _op_fields(op_b[0])["name"] \
                or [r.sub for r in op_a] != [r.sub for r in op_b]:
            return OpDivergence(op_a[0] if op_a else None, op_b[0] if op_b else None, None)
        for ra, rb in zip(op_a, op_b):
            comparison = comparator.compare(Pair(name=ra.name, a=Side([ra]), b=Side([rb])))
            if comparison.diverged:
                return OpDivergence(ra, rb, comparison)
    return None


def zoom_hint(a: Dump, b: Dump, module: str | None) -> str:
    """The capture commands that would record the ops of ``module``'s own code."""
    pattern = f"^{re.escape(module or '')}$"
    commands = []
    for label, dump in (("A", a), ("B", b)):
        command = dump.info.get("command")
        ran = shlex.join(command) if isinstance(command, list) and command else f"<side {label}'s command>"
        commands.append(f"tdiff capture --out {shlex.quote(str(dump.path) + '-ops')} --ops "
                        f"{shlex.quote(pattern)} -- {ran}")
    return (f"no op records of `{path_label(module)}`: to name the op, capture both sides again with "
            f"--ops (or tdiff.capture(..., ops={pattern!r})) and bisect those dumps: " + "; ".join(commands))


def path_label(module: str | None) -> str:
    return module or ROOT_LABEL

