"""The catalogue of known fixes (catalogue.yaml beside this file) and where candidates come from.

    candidates_from("builtin")                     # every entry
    candidates_from("builtin:rmsnorm-fp32,rope-fp32")
    candidates_from("my-fixes.yaml")               # each patch, then each listed combination
    entries_for_kind("norm")                       # the entries that address a boundary kind
    ordered_for_cause(candidates, "rounding")      # batch-invariant / deterministic fixes first
"""

from __future__ import annotations

import functools
from pathlib import Path

from tdiff.bounded_yaml import Fields, load_with_lines
from tdiff.errors import TdiffError
from tdiff.source_patcher.spec import Candidate, PatchSpec, load_patch_file, patch_from_mapping, read_text
from tdiff.vocab.kinds import KINDS

CATALOGUE_FILE = Path(__file__).with_name("catalogue.yaml")
BUILTIN = "builtin"


@functools.cache
def catalogue() -> tuple[Candidate, ...]:
    source = str(CATALOGUE_FILE)
    top = Fields(load_with_lines(read_text(CATALOGUE_FILE), source), source, "the catalogue", ("shared", "entries"), 1)
    entries = tuple(_entry(item, source, top.line_of("entries")) for item in top.items("entries", required=True))
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise TdiffError(f"{source}: an entry name is used twice")
    return entries


def _entry(item, source: str, line: int | None) -> Candidate:
    fields = Fields(item, source, "catalogue entry", ("name", "kinds", "summary", "patches"), line)
    name = fields.text("name", required=True)
    kinds = fields.items("kinds", required=True)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise fields.error(f"entry {name!r}: unknown kinds {unknown} (known: {', '.join(KINDS)})", "kinds")
    patches = tuple(patch_from_mapping(p, source, fields.line_of("patches"), what=f"entry {name!r} patch")
                    for p in fields.items("patches", required=True))
    return Candidate(name=name, patches=patches, kinds=tuple(kinds), summary=fields.text("summary", required=True))


def entries_for_kind(kind: str) -> list[Candidate]:
    """The catalogue entries that address boundaries of ``kind`` (tdiff bisect's vocabulary)."""
    if kind not in KINDS:
        raise TdiffError(f"unknown boundary kind {kind!r} (known: {', '.join(KINDS)})")
    return [entry for entry in catalogue() if kind in entry.kinds]


# What each cause class of tdiff bisect (tdiff.bisect.cause) asks of a fix first, by the words the
# catalogue's names use: rounding (both sides within rounding of the exact op) -> the same kernel
# and order on both sides; precision (one side rounds an intermediate step coarsely) -> fp32 steps.
_FIRST_FOR_CAUSE = {"rounding": ("batch-invariant", "deterministic"), "precision": ("-fp32",)}


def ordered_for_cause(candidates: list[Candidate], cause_class: str | None) -> list[Candidate]:
    """``candidates`` with those that address ``cause_class`` first, each group in its own order;
    unchanged for the other classes (logic, inherited, unknown: no kind of fix is favoured)."""
    words = _FIRST_FOR_CAUSE.get(cause_class or "", ())
    return sorted(candidates, key=lambda c: not any(word in c.name for word in words))


def builtin(names: list[str] | None = None) -> list[Candidate]:
    entries = {entry.name: entry for entry in catalogue()}
    if names is None:
        return list(entries.values())
    unknown = [n for n in names if n not in entries]
    if unknown:
        raise TdiffError(f"no catalogue entry named {unknown[0]!r}; the entries are: {', '.join(entries)}")
    return [entries[n] for n in names]


def _file_and_names(spec: str) -> tuple[str, list[str] | None]:
    """``FILE`` or ``FILE:NAME,...``: a path that exists as written is a file, colons and all."""
    path, colon, names = spec.rpartition(":")
    if not colon or Path(spec).exists() or not Path(path).is_file():
        return spec, None
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    if not chosen:
        raise TdiffError(f"{spec!r}: name at least one patch after '{path}:'")
    return path, chosen


def _chosen(items: list, names: list[str] | None, spec: str) -> list:
    """The items (patches or candidates) of these names, in the order named (None: all)."""
    if names is None:
        return items
    by_name = {item.name: item for item in items}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise TdiffError(f"{spec!r}: no patch named {unknown[0]!r} in the file; it has {', '.join(by_name)}")
    return [by_name[n] for n in names]


def candidates_from(spec: str) -> list[Candidate]:
    """``builtin``, ``builtin:NAME,...``, a patch file, or ``FILE:NAME,...`` (those of its
    candidates: a patch alone, or a combination it lists as ``a+b``)."""
    if spec == BUILTIN or spec.startswith(BUILTIN + ":"):
        names = [n.strip() for n in spec[len(BUILTIN) + 1:].split(",") if n.strip()] if ":" in spec else None
        if names == []:
            raise TdiffError(f"{spec!r}: name at least one entry after 'builtin:'")
        return builtin(names)
    path, names = _file_and_names(spec)
    return _chosen(load_patch_file(path).candidates(), names, spec)


def patches_from(spec: str) -> list[PatchSpec]:
    """Every patch of a file (``FILE:NAME,...``: those patches), or of the named catalogue entries
    (a patch shared by two entries once)."""
    if not (spec == BUILTIN or spec.startswith(BUILTIN + ":")):
        path, names = _file_and_names(spec)
        return _chosen(load_patch_file(path).patches, names, spec)
    patches: dict[str, PatchSpec] = {}
    for entry in candidates_from(spec):
        for patch in entry.patches:
            if patches.setdefault(patch.name, patch).to_config() != patch.to_config():
                raise TdiffError(f"catalogue entries define patch {patch.name!r} differently")
    return list(patches.values())
