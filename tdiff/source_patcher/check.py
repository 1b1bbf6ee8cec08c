"""Validate patches against the installed packages without running them (`tdiff patch check`).

Each target is found in the installed files (nothing is imported but replacement and activation
functions), its pin compared, its edits applied and the result compiled, exactly as at run time;
patches on one target are checked in order, each on the text the previous one left.
"""

from __future__ import annotations

from dataclasses import dataclass

from tdiff.source_patcher.apply import pin_mismatch, resolve_reference
from tdiff.source_patcher.codegen import (CompileError, check_replacement_signature, compile_factory, edited_node,
                                          static_freevars, trampoline_node)
from tdiff.source_patcher.edits import EditError, apply_edits
from tdiff.source_patcher.errors import PatchError, TargetNotInstalled
from tdiff.source_patcher.source import TargetSource, locate, split_target
from tdiff.source_patcher.spec import PatchSpec

OK, STALE, NOT_INSTALLED = "ok", "stale", "not installed"


@dataclass
class CheckResult:
    patch: PatchSpec
    status: str                     # "ok" | "stale" | "not installed"
    reason: str | None = None
    location: str | None = None     # file:line of the target's def
    sha256: str | None = None       # of the target's source text (what a pin holds)

    def to_json(self) -> dict:
        return {"name": self.patch.name, "target": self.patch.target, "status": self.status,
                "reason": self.reason, "location": self.location, "sha256": self.sha256,
                "origin": self.patch.origin}


def check_patches(patches: list[PatchSpec]) -> list[CheckResult]:
    texts: dict[str, str | None] = {}   # target -> its text after the patches checked so far
    return [check_patch(patch, texts) for patch in patches]


def check_patch(patch: PatchSpec, texts: dict | None = None) -> CheckResult:
    texts = {} if texts is None else texts
    source = None
    try:
        if patch.activate is not None:
            split_target(patch.name, patch.target)
            resolve_reference(patch, patch.activate)
            return CheckResult(patch, OK)
        source = locate(patch.name, patch.target)
        if patch.pin is not None and patch.pin != source.sha256:
            raise PatchError(patch.name, patch.target, pin_mismatch(patch.pin, source))
        texts[patch.target] = _check_change(patch, source, texts.get(patch.target, source.text))
        return CheckResult(patch, OK, location=source.location, sha256=source.sha256)
    except TargetNotInstalled as exc:
        return CheckResult(patch, NOT_INSTALLED if patch.optional else STALE, exc.reason)
    except PatchError as exc:
        return CheckResult(patch, STALE, exc.reason, location=source.location if source else None,
                           sha256=source.sha256 if source else None)


def _check_change(patch: PatchSpec, source: TargetSource, current: str | None) -> str | None:
    freevars = static_freevars(source.node, in_class=source.in_class)
    try:
        if patch.edits:
            if current is None:
                raise PatchError(patch.name, patch.target, "an earlier patch replaced this function wholesale; "
                                                           "edits cannot apply on top of it")
            new_text = apply_edits(current, patch.edits, first_line=source.def_line)
            node, changed = edited_node(source, new_text, patch.preamble)
        else:
            assert patch.replace_with is not None, "activation patches are checked elsewhere"
            replacement = resolve_reference(patch, patch.replace_with)
            check_replacement_signature(source.node, replacement)
            node, changed, new_text = trampoline_node(source, patch.replace_with), False, None
        compile_factory(node, freevars, signature_changed=changed, future_flags=source.future_flags,
                        filename=f"<tdiff check {patch.name}>")
    except (EditError, CompileError) as exc:
        raise PatchError(patch.name, patch.target, str(exc)) from None
    return new_text
