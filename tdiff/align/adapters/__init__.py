"""Adapters: one per framework, picked from the classes a dump's modules come from."""

from __future__ import annotations

from collections import Counter

from tdiff.align.adapters.base import Adapter, Canonicalized, Rule, View
from tdiff.align.adapters.hf import HuggingFaceAdapter
from tdiff.align.adapters.megatron import MegatronAdapter
from tdiff.align.adapters.sglang import SGLangAdapter
from tdiff.store import Dump

ADAPTERS: dict[str, type[Adapter]] = {
    HuggingFaceAdapter.framework: HuggingFaceAdapter,
    MegatronAdapter.framework: MegatronAdapter,
    SGLangAdapter.framework: SGLangAdapter,
}

# packages that are not a model's framework
_GENERIC = {"torch", "tdiff", ""}


def framework_of(dump: Dump) -> str | None:
    """The framework of a dump's model: the package most of its non-torch module classes come
    from (``attrs["framework"]``), preferring one an adapter knows. A dump that records no module
    classes at all (SGLang's dumper output) goes to the adapter that builds the most canonical
    boundaries from it (module names alone are ambiguous: SGLang and transformers share most of
    them). None when nothing says."""
    counts = Counter(r.attrs.get("framework") for r in dump.records if r.role != "explicit")
    counts = Counter({f: n for f, n in counts.items() if isinstance(f, str) and f not in _GENERIC})
    known = [f for f, _ in counts.most_common() if f in ADAPTERS]
    if known:
        return known[0]
    if not counts and all(r.module_class is None for r in dump.records):
        scores = Counter({f: len(cls().canonicalize(dump).tensors) for f, cls in ADAPTERS.items()})
        best = scores.most_common(2)
        if best and best[0][1] > 0 and (len(best) == 1 or best[0][1] > best[1][1]):
            return best[0][0]
    return counts.most_common(1)[0][0] if counts else None


def adapter_for(framework: str | None) -> Adapter | None:
    cls = ADAPTERS.get(framework or "")
    return cls() if cls else None


__all__ = ["ADAPTERS", "Adapter", "Canonicalized", "Rule", "View", "adapter_for", "framework_of",
           "HuggingFaceAdapter", "MegatronAdapter", "SGLangAdapter"]
