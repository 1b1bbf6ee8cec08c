"""Terminal lines that say how two dumps were aligned (after the comparison table)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from tdiff.align.pairing import Alignment, SideAlignment
from tdiff.align.tokens import TokenAlignment


def render_alignment(alignment: Alignment, console: Console) -> None:
    a, b = alignment.a, alignment.b
    console.print(f"aligned by canonical boundary: A {escape(a.side)} ({a.adapter}, {a.canonical} tensors), "
                  f"B {escape(b.side)} ({b.adapter}, {b.canonical} tensors)")
    for label, side in (("A", a), ("B", b)):
        _render_side(label, side, console)
    unmapped = [f"{label} {len(side.unmapped)}" for label, side in (("A", a), ("B", b)) if side.unmapped]
    if unmapped:
        console.print(f"  not mapped to a canonical boundary (distinct names): {', '.join(unmapped)}; "
                      "--json lists them")
    for warning in alignment.warnings:
        console.print(f"[yellow]warning[/yellow]: {escape(warning)}")


def _render_side(label: str, side: SideAlignment, console: Console) -> None:
    for boundary, entry in side.not_exposed.items():
        console.print(f"  not exposed by {label} ({side.adapter}), {entry['skipped']} not compared: "
                      f"{boundary}: {escape(entry['reason'])}")
    for name, reason in side.uncertain:
        console.print(f"  only on {label}, not compared: {name}: {escape(reason)}")
    for name, reason in side.unresolved:
        console.print(f"  [yellow]cannot build on {label}[/yellow]: {name}: {escape(reason)}")
    if side.unmatched:
        more = len(side.unmatched) - 8
        shown = ", ".join(side.unmatched[:8]) + (f" and {more} more" if more > 0 else "")
        console.print(f"  [red]only on {label}[/red] (the other side could expose them): {shown}")


def render_token_alignment(alignment: TokenAlignment, console: Console) -> None:
    pairs = alignment.sequences
    shared = sum(p.shared for p in pairs)
    console.print(f"aligned by token: {len(pairs)} sequence pair(s) matched by token ids, {shared:,} positions "
                  "fed by both")
    one_sided = [(label, p.a, p.b, positions) for p in pairs
                 for label, positions in (("A", p.only_a), ("B", p.only_b)) if positions]
    for label, a, b, positions in one_sided[:8]:
        shown = ", ".join(map(str, positions[:6])) + (" ..." if len(positions) > 6 else "")
        console.print(f"  only on {label} (not compared): sequence {a} (A) / {b} (B), position(s) {shown}")
    if len(one_sided) > 8:
        console.print(f"  ... and {len(one_sided) - 8} more sequence(s) with one-sided positions; --json lists them")
    for label, unmatched in (("A", alignment.unmatched_a), ("B", alignment.unmatched_b)):
        if unmatched:
            shown = ", ".join(f"{u['seq']} ({u['tokens']} tokens)" for u in unmatched[:8])
            console.print(f"  [yellow]sequences only on {label}[/yellow] (no partner by token ids): {shown}")
    if alignment.not_aligned:
        names = ", ".join(escape(name) for name, _ in alignment.not_aligned[:6])
        more = f" and {len(alignment.not_aligned) - 6} more" if len(alignment.not_aligned) > 6 else ""
        console.print(f"  not token-aligned, not compared (no row per token): {names}{more}; --json says why")
    for name, reason in alignment.partly[:6]:
        console.print(f"  [yellow]partly token-aligned[/yellow]: {escape(name)}: {escape(reason)}")
    if len(alignment.partly) > 6:
        console.print(f"  ... and {len(alignment.partly) - 6} more partly token-aligned tensors; --json lists them")
    if alignment.boundaries is not None:
        render_alignment(alignment.boundaries, console)
