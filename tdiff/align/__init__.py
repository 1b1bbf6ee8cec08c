"""Cross-framework alignment: compare Hugging Face transformers, Megatron-core and SGLang dumps.

The stages, in the spirit of SGLang's comparator (plan from metadata, execute on tensors, keep
the plan so a reader sees how two tensors were aligned):

1. an adapter per framework (tdiff.align.adapters), picked from the classes the dump's modules
   come from, finds the canonical boundaries (tdiff.vocab.boundaries) among its records;
2. the pieces each rank holds are grouped and their reassembly planned (tdiff.align.unshard);
3. CanonicalPairing pairs both sides by canonical name and says what could not be aligned;
4. when a pair is compared, its plan runs: combine records, split fused outputs, unshard, move
   tokens first (tdiff.align.ops).

Runs of different token layouts (prefill and decode steps against one forward) are paired
token by token over either pairing (tdiff.align.tokens, docs/ALIGNMENT.md).

``choose_pairing`` is the one entry point the rest of tdiff calls.
"""

from __future__ import annotations

from pathlib import Path

from tdiff.align.adapters import ADAPTERS, Adapter, adapter_for, framework_of
from tdiff.align.pairing import Alignment, CanonicalPairing
from tdiff.align.tokens import TokenAlignment, TokenPairing, layouts_differ
from tdiff.compare.pairing import NamePairing, Pairing
from tdiff.errors import TdiffError
from tdiff.store import Dump


ALIGN_MODES = ("tokens", "names", "boundaries")


def choose_pairing(dump_a: Dump, dump_b: Dump, mapping: str | Path | None = None,
                   align: str | None = None) -> Pairing:
    """The pairing for two dumps: by name when both are tdiff captures with the same parallel
    layout, no mapping file is given, and either their frameworks agree or their module paths line
    up (run B swapped a module for a subclass of the user's own: its classes say nothing about the
    model); by canonical boundary otherwise (two frameworks adapters know, TP=2 vs TP=1, a dump
    imported from SGLang's dumper, a mapping file). Over either, by token when both dumps carry
    token metadata and their steps or token layouts differ (unless no tensor has rows to locate by
    token: then the pairing above stands).

    ``align`` (``--align``) forces one: "names", "boundaries" or "tokens" (over the pairing the
    rules above pick).

    Raises TdiffError when a side's model is one no adapter knows and no mapping covers it, or
    when tokens are asked for and a dump carries no token metadata.
    """
    if align is not None and align not in ALIGN_MODES:
        raise TdiffError(f"--align {align!r}: use one of {', '.join(ALIGN_MODES)}")
    if align == "names":
        if mapping is not None:
            raise TdiffError("--align names pairs by module path: it takes no --mapping")
        return NamePairing()
    base = _base_pairing(dump_a, dump_b, mapping, by_boundary=align == "boundaries")
    if align == "tokens":
        return TokenPairing(base)
    if align is None and layouts_differ(dump_a, dump_b):
        return TokenPairing(base, chosen=True)
    return base


def _base_pairing(dump_a: Dump, dump_b: Dump, mapping: str | Path | None, *, by_boundary: bool) -> Pairing:
    frameworks = (framework_of(dump_a), framework_of(dump_b))
    same_format = dump_a.info.get("format") == dump_b.info.get("format")
    same_model = frameworks[0] == frameworks[1] or (
        not all(f in ADAPTERS for f in frameworks) and _paths_line_up(dump_a, dump_b))
    if not by_boundary and mapping is None and same_format and same_model and _layout(dump_a) == _layout(dump_b):
        return NamePairing()
    adapters = [adapter_for(f) for f in frameworks]
    if mapping is not None:
        from tdiff.align.adapters.mapping import load_mapping

        custom = load_mapping(mapping)
        sides = {"a": (0,), "b": (1,), "both": (0, 1)}[custom.sides] if custom.sides else \
            tuple(i for i, adapter in enumerate(adapters) if adapter is None)
        if not sides:
            raise TdiffError(f"--mapping {mapping}: both dumps have built-in adapters ({frameworks[0]}, "
                             f"{frameworks[1]}); say which side the file maps with `side: a` or `side: b`")
        for i in sides:
            adapters[i] = custom
    return CanonicalPairing(_known(adapters[0], dump_a, frameworks[0]), _known(adapters[1], dump_b, frameworks[1]))


def _known(adapter: Adapter | None, dump: Dump, framework: str | None) -> Adapter:
    if adapter is None:
        what = f"classes from package {framework!r}" if framework else "no recorded module classes"
        raise TdiffError(f"{dump.path}: no adapter knows this model ({what}); write a mapping file "
                         "(docs/BOUNDARIES.md) and pass --mapping FILE")
    return adapter


def _paths_line_up(dump_a: Dump, dump_b: Dump) -> bool:
    """One dump's module paths are all among the other's: the same model, perhaps captured with a
    narrower --select."""
    paths_a, paths_b = _module_paths(dump_a), _module_paths(dump_b)
    return bool(paths_a and paths_b) and (paths_a <= paths_b or paths_b <= paths_a)


def _module_paths(dump: Dump) -> set[str]:
    return {r.module for r in dump.records if r.role != "explicit"}


def _layout(dump: Dump) -> dict:
    """The parallel layout a dump's ranks ran with: axis -> size."""
    for record in dump.records:
        parallel = record.attrs.get("parallel")
        if isinstance(parallel, dict):
            return {axis: value[1] for axis, value in parallel.items()
                    if isinstance(value, (list, tuple)) and len(value) == 2}
    return {}


__all__ = ["ALIGN_MODES", "Alignment", "CanonicalPairing", "TokenAlignment", "TokenPairing", "choose_pairing"]
