"""Terminal lines that say how two dumps were aligned (after the comparison table)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from tdiff.align.pairing import Alignment, SideAlignment


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
