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
from itertools import groupby

from tdiff.bisect.result import Divergence, OpDivergence
from tdiff.bisect.verdict import EventComparator
from tdiff.compare.pairing import Pair, Side
from tdiff.store import Dump, Record
from tdiff.vocab.kinds import op_kind
from tdiff.vocab.paths import ROOT_LABEL


STATE_NOT_RECORDED = "parameters and buffers are not recorded"
MADE_UNRECORDED = "made where no op record holds it: before the call, or on another thread"


def _found(a: Record | None, b: Record | None, parted: bool) -> OpDivergence:
    """The op where the runs part, from each side's op record (None: that side's ops ended)."""
    op_a, op_b = _op_fields(a), _op_fields(b)
    return OpDivergence(name=op_a.get("name"), index=op_a.get("index"), function=op_a.get("function"),
                        source=op_a.get("source"), name_b=op_b.get("name"), index_b=op_b.get("index"),
                        function_b=op_b.get("function"), source_b=op_b.get("source"), parted=parted,
                        not_compared=None if parted else uncompared_op_inputs(op_a, op_b))


def uncompared_op_inputs(op_a: dict, op_b: dict) -> str | None:
    """The inputs of an op that no record held on either side (so bisect never compared them):
    "<names> (<why>); ...", the module's parameters and buffers by name, other tensors by
    position; None when every input was a record compared before the op."""
    groups: dict[str, list[str]] = {}
    for op in (op_a, op_b):
        inputs, state = op.get("inputs") or [], op.get("state") or []
        for position, seq in enumerate(inputs):
            if seq is not None:
                continue
            name = state[position] if position < len(state) else None
            why = STATE_NOT_RECORDED if name is not None else MADE_UNRECORDED
            label = name if name is not None else f"input {position}"
            if label not in groups.setdefault(why, []):
                groups[why].append(label)
    return "; ".join(f"{', '.join(names)} ({why})" for why, names in groups.items()) or None


def _op_fields(record: Record | None) -> dict:
    """An op record's ``op`` (name, index, function, source, inputs); {} for no record."""
    return (record.op or {}) if record is not None else {}


def descend(a: Dump, b: Dump, divergence: Divergence, comparator: EventComparator) -> list[str]:
    """Name the op inside the culprit's call (``divergence.op``, and its kind); returns notes."""
    if not own_code(divergence):
        return []
    call = divergence.call if divergence.event == "output" else divergence.module_call
    if divergence.token is not None:
        # rows met by token: a decode step's ops and a prefill's have other shapes and calls
        if any(r.module in (divergence.module, divergence.module_b) for r in (*a.ops, *b.ops)):
            return [(f"op records of `{path_label(divergence.module)}` are not compared: the runs were aligned by "
                     "token, and a decode step's ops and a prefill's have other shapes; bisect stops at the module")]
        return []
    ops_a = _call_ops(a, divergence.module, divergence.step, call, divergence.rank)
    ops_b = _call_ops(b, divergence.module_b, divergence.step, call, divergence.rank)
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
    attach(divergence, found)
    return limits


def attach(divergence: Divergence, op: OpDivergence) -> None:
    """Name ``op`` as the divergence's op; its kind, where the op and its function say one."""
    divergence.op = op
    name, function = (op.name, op.function) if op.name is not None else (op.name_b, op.function_b)
    divergence.kind = op_kind(name or "", function or "", divergence.kind) or divergence.kind


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
            return _found(op_a[0] if op_a else None, op_b[0] if op_b else None, parted=True)
        for ra, rb in zip(op_a, op_b):
            if comparator.compare(Pair(name=ra.name, a=Side([ra]), b=Side([rb]))).diverged:
                return _found(ra, rb, parted=False)
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

