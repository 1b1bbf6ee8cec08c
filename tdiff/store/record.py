"""One manifest record: a captured tensor's identity, metadata and where its bytes are.

Records are validated field by field when read, so a corrupted manifest is reported with the
field at fault instead of failing later.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import types
from typing import Any, Union, get_args, get_origin, get_type_hints
from dataclasses import dataclass, field

from tdiff.errors import DumpError

ROLES = ("input", "output", "explicit", "op")
MAIN_THREAD = "MainThread"   # threading's name of a process's first thread
_SAFE_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


# Not frozen: a frozen dataclass sets each of its 23 fields through object.__setattr__, which made
# building a record (once per captured tensor) 8x slower, and a copy of it with its contents cost
# the writer as much again. Each record is built for one captured tensor: the writer completes it
# in place (``set_contents``), once; readers set what only they know (its part)
@dataclass(slots=True)
class Record:
    seq: int                    # execution order within the process that wrote it
    name: str                   # module path plus sub-name, e.g. "model.layers.0.self_attn[0]"
    module: str                 # module path ("" for the outermost model)
    role: str                   # "input" | "output" | "explicit" | "op"
    step: int                   # forward pass index
    call: int                   # invocation index of this module (or explicit name) within the step
    rank: int
    dtype: str
    shape: tuple[int, ...]
    sub: str = ""               # path inside a nested input/output ("0", "hidden_states", "1.key")
    module_class: str | None = None
    parent: str | None = None   # module path of the enclosing call, None at the top
    depth: int = 0
    layer: int | None = None    # the decoder layer that made the call, where the module path says another
    # the recording thread's label (tdiff.hooks.running): step and call count per thread. Always
    # written; dumps from before it was read as "MainThread"
    thread: str = field(default=MAIN_THREAD, metadata={"always_written": True})
    device: str = "cpu"
    stats: dict | None = None
    fingerprint: str | None = None
    file: str | None = None     # shard file, relative to the dump; None when only stats were kept
    key: str | None = None      # tensor key inside the shard
    alias_of: int | None = None  # seq of an earlier record of the same tensor (stored once)
    attrs: dict = field(default_factory=dict)  # extra metadata: parallel ranks, canonical names
    op: dict | None = None      # role "op": the ATen op, its index in the call, where it ran, its inputs
    part: str = field(default="", metadata={"stored": False})  # the writing process's manifest part (set by the reader)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def has_data(self) -> bool:
        return self.file is not None

    @property
    def pair_key(self) -> tuple:
        """What identifies the same tensor in two runs of the same program."""
        return (self.name, self.step, self.call, self.role, self.rank, self.thread)

    @property
    def bound_key(self) -> tuple:
        """:attr:`pair_key` with an input passed by position named by the parameter it binds to
        (attrs "bound"), as if passed by keyword."""
        return (self.attrs.get("bound") or self.name, *self.pair_key[1:])

    def copy(self) -> Record:
        """A copy (sharing its attrs and op dicts): a fifth of ``dataclasses.replace``'s time, which
        counts where a CUDA graph's every replay makes a copy of each record its capture made."""
        return Record(*_ALL_VALUES(self))

    def set_contents(self, stats: dict | None, fingerprint: str | None, file: str | None = None,
                     key: str | None = None) -> None:
        """What the writer learnt of the record's bytes."""
        self.stats, self.fingerprint, self.file, self.key = stats, fingerprint, file, key

    def to_json(self) -> dict:
        """The record as stored: optional fields at their default value are left out."""
        out = {}
        for (name, optional, default), value in zip(_STORED_FIELDS, _STORED_VALUES(self)):
            # most defaults are None: an identity test spares comparing dicts and strings
            if optional and (value is default or (default is not None and value == default)):
                continue
            out[name] = value
        out["shape"] = list(self.shape)  # the one tuple field
        return out

    @classmethod
    def from_json(cls, data: object, where: str = "record") -> Record:
        if not isinstance(data, dict):
            raise DumpError(f"{where}: a record must be a JSON object")
        values: dict[str, Any] = {}   # each value checked against the JSON type of its field
        for name, (kind, optional) in _SCHEMA.items():
            if name not in data or data[name] is None:
                if not optional:
                    raise DumpError(f"{where}: field {name!r} is missing")
                continue
            value = data[name]
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise DumpError(f"{where}: field {name!r} has the wrong type ({type(value).__name__})")
            values[name] = value
        shape = values["shape"]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise DumpError(f"{where}: field 'shape' must be a list of non-negative integers")
        values["shape"] = tuple(shape)
        if values["role"] not in ROLES:
            raise DumpError(f"{where}: field 'role' must be one of {', '.join(ROLES)}")
        for name in ("seq", "step", "call", "rank", "depth", "layer"):
            if name in values and values[name] < 0:
                raise DumpError(f"{where}: field {name!r} must not be negative")
        if ("file" in values) != ("key" in values):
            raise DumpError(f"{where}: fields 'file' and 'key' must be given together")
        if "file" in values and not _SAFE_FILE.fullmatch(values["file"]):
            raise DumpError(f"{where}: field 'file' must name a file inside the dump, not {values['file']!r}")
        if (values["role"] == "op") != ("op" in values):
            raise DumpError(f"{where}: field 'op' must be given exactly for records of role 'op'")
        if "op" in values:
            _check_op(values["op"], where)
        return cls(**values)


_OP_FIELDS = {"name": str, "index": int, "function": str, "source": str, "inputs": list}


def _check_op(op: dict, where: str) -> None:
    """An op record's ``op``: {"name": "aten::mul.Tensor", "index": 3, "function": "apply_rotary_pos_emb",
    "source": "modeling_qwen2.py:125", "inputs": [12, null]} (inputs: the seq of the record holding
    each tensor input's value before the op, null where none does)."""
    for name, kind in _OP_FIELDS.items():
        value = op.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise DumpError(f"{where}: field 'op.{name}' is missing or has the wrong type")
    if op["index"] < 0 or not all(i is None or (isinstance(i, int) and not isinstance(i, bool) and i >= 0)
                                  for i in op["inputs"]):
        raise DumpError(f"{where}: fields 'op.index' and 'op.inputs' must hold non-negative integers")


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _optional(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _json_type(hint) -> type:
    """What JSON holds for a field of type ``hint``: ``str | None`` -> str, ``tuple[int, ...]`` -> list."""
    members = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    (member,) = [m for m in members if m is not type(None)]
    origin = get_origin(member) or member
    return list if origin is tuple else origin


# The stored fields and, for reading them back, each one's JSON type and whether it may be left
# out: all derived from the dataclass, the one definition of a record (docs/FORMAT.md lists them).
_STORED = [f for f in dataclasses.fields(Record) if f.metadata.get("stored", True)]
_HINTS = get_type_hints(Record)
_SCHEMA = {f.name: (_json_type(_HINTS[f.name]), _optional(f)) for f in _STORED}
# (name, may be left out, default) of each stored field, computed once: to_json runs per record
_STORED_FIELDS = tuple((f.name, _optional(f) and not f.metadata.get("always_written", False),
                        _default(f) if _optional(f) else None) for f in _STORED)
_ALL_VALUES = operator.attrgetter(*(f.name for f in dataclasses.fields(Record)))   # in __init__'s order
_STORED_VALUES = operator.attrgetter(*(name for name, _, _ in _STORED_FIELDS))
