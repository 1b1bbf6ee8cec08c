"""Patch specs: the YAML format of docs/PATCHES.md, read safely and validated with line numbers.

    patches:
      - name: fp32-variance
        target: transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm.forward
        pin: 9f2c...                    # optional: sha256 of the target's source text
        preamble: "import torch"        # optional: statements the edited code needs
        edits:
          - match: "variance = hidden_states.pow(2).mean(-1, keepdim=True)"
            replacement: "variance = hidden_states.float().pow(2).mean(-1, keepdim=True)"
      - name: my-fix
        target: package.module.function
        replace_with: mypkg.fixes:function
    combinations:                        # optional, for `tdiff patch try`
      - [fp32-variance, my-fix]

Files written for SGLang's own source patcher (``sglang.srt.debug_utils.source_patcher``, the YAML
that ``DUMPER_SOURCE_PATCHER_CONFIG`` names) are read as they are: a patch without ``name`` is
named after its target (``#2``, ``#3`` for a second and third patch of one target), and an edit
with only ``match`` (or only blank actions) deletes the matched lines, SGLang's default
``replacement: ""``.

Every mistake (bad YAML, an unknown key, a wrong type, a duplicate name) is reported with the file
and line at fault. YAML is read with the safe loader only.
"""

from __future__ import annotations

import re
from typing import Any
from dataclasses import dataclass, field
from pathlib import Path

from tdiff.bounded_yaml import Fields, brief, load_with_lines
from tdiff.errors import TdiffError
from tdiff.store.files import read_regular

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(#[0-9]+)?")   # "#2": a target's second unnamed patch
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*")
_REFERENCE = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
EDIT_ACTIONS = ("replacement", "prepend", "append")
PATCH_KEYS = ("name", "target", "pin", "preamble", "edits", "replace_with", "activate", "optional")
MODES = ("edits", "replace_with", "activate")


@dataclass(frozen=True)
class Edit:
    """Find the lines of ``match`` (whitespace-tolerant) and replace them, or add lines around them."""

    match: str
    action: str                 # "replacement" | "prepend" | "append"
    text: str
    line: int | None = None     # where the edit is written in its file

    def to_config(self) -> dict:
        return {"match": self.match, self.action: self.text}


@dataclass(frozen=True)
class PatchSpec:
    """One change to one target: line edits, a whole-function replacement, or an activation hook."""

    name: str
    target: str
    edits: tuple[Edit, ...] = ()
    replace_with: str | None = None   # "module:function" called instead of the target
    activate: str | None = None       # "module:function" called once the target module is imported
    pin: str | None = None            # sha256 of the target's original source text
    preamble: str | None = None       # statements run at the start of the edited function
    optional: bool = False            # skip (do not fail) where the target's package is not installed
    origin: str = ""                  # "patches.yaml line 3", for messages

    @property
    def mode(self) -> str:
        return "edits" if self.edits else "replace_with" if self.replace_with else "activate"

    def to_config(self) -> dict:
        out: dict = {"name": self.name, "target": self.target}
        if self.edits:
            out["edits"] = [e.to_config() for e in self.edits]
        for key in ("replace_with", "activate", "pin", "preamble"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.optional:
            out["optional"] = True
        return out


@dataclass(frozen=True)
class Candidate:
    """What `tdiff patch try` runs once: a named set of patches (one patch, a combination, or a
    catalogue entry with one patch per framework it applies to)."""

    name: str
    patches: tuple[PatchSpec, ...]
    kinds: tuple[str, ...] = ()       # boundary kinds it addresses (catalogue entries)
    summary: str = ""


@dataclass
class PatchFile:
    source: str
    patches: list[PatchSpec]
    combinations: list[tuple[str, ...]] = field(default_factory=list)

    def candidates(self) -> list[Candidate]:
        """Each patch alone, then each combination the file lists."""
        by_name = {p.name: p for p in self.patches}
        alone = [Candidate(p.name, (p,)) for p in self.patches]
        combined = [Candidate("+".join(names), tuple(by_name[n] for n in names)) for names in self.combinations]
        return alone + combined


def read_text(path: str | Path) -> str:
    try:
        return read_regular(Path(path), "file").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TdiffError(f"{path}: cannot be read: {exc}") from None


def patch_from_mapping(data, source: str, line: int | None = None, *, what: str = "patch") -> PatchSpec:
    """Validate one patch entry (from YAML, or from the JSON a parent process passed on)."""
    named = data.get("name") if isinstance(data, dict) else None
    fields = Fields(data, source, f"{what} {named!r}" if isinstance(named, str) else what, PATCH_KEYS, line)
    name = fields.text("name", required=True, pattern=_NAME,
                       describe="a name of letters, digits, '.', '_' and '-' (and '#N' last)")
    fields.what = f"patch {name!r}"
    target = fields.text("target", required=True, pattern=_DOTTED, describe="a dotted path like package.module.Class.method")
    present = [key for key in MODES if key in fields.data]
    if len(present) != 1:
        raise fields.error(f"patch {name!r}: give exactly one of edits, replace_with or activate"
                           + (f" (found {', '.join(present)})" if present else ""))
    mode = present[0]
    reference: dict[str, Any] = dict(pattern=_REFERENCE, describe="a reference like package.module:function")
    replace_with = fields.text("replace_with", **reference)
    activate = fields.text("activate", **reference)
    pin = fields.text("pin", pattern=_SHA256, describe="a sha256 (64 lowercase hex digits)")
    preamble = fields.text("preamble")
    if preamble is not None and mode != "edits":
        raise fields.error(f"patch {name!r}: preamble goes with edits only", "preamble")
    if pin is not None and mode == "activate":
        raise fields.error(f"patch {name!r}: pin goes with edits or replace_with (activate has no source)", "pin")
    if mode != "activate" and "." not in target:
        raise fields.error(f"patch {name!r}: target {target!r} names a module; edits and replace_with need "
                           "a function: package.module.function or package.module.Class.method", "target")
    edits = tuple(_edit(item, source, fields, index) for index, item in enumerate(fields.items("edits"), 1))
    return PatchSpec(name=name, target=target, edits=edits, replace_with=replace_with, activate=activate,
                     pin=pin, preamble=preamble, optional=fields.flag("optional"),
                     origin=fields.where())


def _edit(item, source: str, parent: Fields, index: int) -> Edit:
    edit = Fields(item, source, f"{parent.what} edit {index}", ("match", *EDIT_ACTIONS), parent.line_of("edits"))
    match = edit.text("match", required=True)
    given = {a: edit.text(a, required=True, allow_empty=True) for a in EDIT_ACTIONS if a in edit.data}
    # as SGLang's patcher: an action left blank is not given, and none given deletes the match
    actions = [a for a, text in given.items() if text.strip()]
    if len(actions) > 1:
        raise edit.error(f"{edit.what}: give exactly one of replacement, prepend or append "
                         f"(found {', '.join(actions)})")
    action = actions[0] if actions else "replacement"
    return Edit(match=match, action=action, text=given[action] if actions else "", line=edit.line)


def parse_patch_file(text: str, source: str) -> PatchFile:
    data = load_with_lines(text, source)
    top = Fields(data, source, "the file", ("patches", "combinations"), 1)
    items = top.items("patches", required=True)
    _name_after_targets(items)
    patches = [patch_from_mapping(item, source, top.line_of("patches")) for item in items]
    first_line: dict[str, str] = {}
    for patch in patches:
        if patch.name in first_line:
            raise TdiffError(f"{patch.origin}: patch name {patch.name!r} is used twice (first at {first_line[patch.name]})")
        first_line[patch.name] = patch.origin
    combinations = [_combination(item, top, set(first_line)) for item in top.items("combinations")]
    return PatchFile(source=source, patches=patches, combinations=combinations)


def _name_after_targets(items: list) -> None:
    """Name each patch without a ``name`` (SGLang's format has none) after its target: the
    target's second patch ``TARGET#2``, its third ``TARGET#3``."""
    seen: dict[str, int] = {}
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("target"), str):
            continue
        target = item["target"]
        seen[target] = seen.get(target, 0) + 1
        if "name" not in item:
            item["name"] = target if seen[target] == 1 else f"{target}#{seen[target]}"


def _combination(item, top: Fields, names: set[str]) -> tuple[str, ...]:
    where = top.where("combinations")
    if not isinstance(item, list) or len(item) < 2 or not all(isinstance(n, str) for n in item):
        raise TdiffError(f"{where}: each combination must be a list of two or more patch names, not {brief(item)}")
    unknown = [n for n in item if n not in names]
    if unknown:
        raise TdiffError(f"{where}: combination {brief(item)} names unknown patch(es): {', '.join(unknown)}")
    if len(set(item)) != len(item):
        raise TdiffError(f"{where}: combination {brief(item)} names a patch twice")
    return tuple(item)


def load_patch_file(path: str | Path) -> PatchFile:
    return parse_patch_file(read_text(path), str(path))


def patches_from_config(config: dict, source: str = "TDIFF_PATCHES") -> list[PatchSpec]:
    """The patches a parent process handed over as JSON (see :func:`patches_config`)."""
    if not isinstance(config, dict) or not isinstance(config.get("patches"), list):
        raise TdiffError(f"{source}: expected {{\"patches\": [...]}}")
    return [patch_from_mapping(item, source) for item in config["patches"]]


def patches_config(patches: list[PatchSpec]) -> dict:
    """JSON-ready form of patches for a child process's environment."""
    return {"patches": [p.to_config() for p in patches]}
