"""The options of a capture, declared once.

:class:`CaptureOptions` is the one declaration of what a capture can be told: each field's name is
``tdiff.capture``'s keyword argument and the key its value travels under to the processes a
command starts (tdiff.launch), its default is the default of both, and its :class:`Flag` (when it
has one) is ``tdiff capture``'s option: its spelling and help, from which tdiff/cli/options.py
builds the click option. Values are checked here, once, whichever way they came.

Examples:
    >>> CaptureOptions(layers="0-3", mode="stats").layer_set()
    frozenset({0, 1, 2, 3})
    >>> CaptureOptions.from_json(CaptureOptions(select=["mlp"]).to_json()).select
    ('mlp',)

Light at import (no torch): `tdiff capture --help` and every process a command starts read it.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tdiff.errors import TdiffError
from tdiff.store.manifest import STORAGES
from tdiff.vocab.parse import compile_patterns, parse_ranges

MODES = ("full", "stats")


@dataclass(frozen=True)
class Flag:
    """An option's spelling on ``tdiff capture``. ``help`` ends without its full stop: a command
    that offers the flag for a purpose of its own (patch try, bisect) adds a word before it."""

    names: tuple[str, ...]          # the option first, then its aliases
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] = ()   # the values it takes, when they are a fixed few
    minimum: int | None = None      # an integer option's least value
    size: bool = False              # written as a size ("2GiB") on the command line, bytes in Python

    @property
    def name(self) -> str:
        return self.names[0]


def _option(default, flag: Flag | None, doc: str = ""):
    """A field with its flag, or (an option Python alone has) its ``doc``."""
    return field(default=default, metadata={"flag": flag, "doc": flag.help if flag is not None else doc})


@dataclass(frozen=True)
class CaptureOptions:
    """What a capture records and how it writes it (the dump directory and, in Python, the model
    are not options: they are what is captured, and where)."""

    side: str | None = _option(None, Flag(("--side",), "Label of this run in reports (default: the directory name)"))
    select: tuple[str, ...] = _option((), Flag(("--select",), "Record only modules whose path matches (repeatable)",
                                               metavar="REGEX"))
    exclude: tuple[str, ...] = _option((), Flag(("--exclude",), "Skip modules and dumps whose name matches "
                                                "(repeatable)", metavar="REGEX"))
    # ranges as written ("0-3,7"), or from Python an int or ints
    layers: str | int | tuple[int, ...] | None = _option(None, Flag(("--layers", "--layer"), "Record only these "
                                                                    "decoder layers, e.g. 1 or 0-3,7",
                                                                    metavar="RANGES"))
    steps: str | int | tuple[int, ...] | None = _option(None, Flag(("--steps",), "Record only these steps (forward "
                                                                   "passes), e.g. 0-1", metavar="RANGES"))
    ops: tuple[str, ...] = _option((), Flag(("--ops",), (
        "Inside the forward of modules whose path matches, record every ATen op's output too, with its function "
        "and source line (repeatable; docs/BISECT.md)"), metavar="REGEX"))
    params: bool = _option(False, Flag(("--params",), (
        "Store each recorded module's parameters and buffers, once per dump (by fingerprint), for bisect's "
        "exact-reference replay of the culprit (docs/BISECT.md)")))
    mode: str = _option("full", Flag(("--mode",), "full: store tensors; stats: fingerprints and statistics only",
                                     choices=MODES))
    storage: str = _option("safetensors", Flag(("--format",), "Tensor file format", choices=STORAGES))
    max_pending_bytes: int = _option(2 << 30, Flag(("--max-pending",), (
        "Host memory pending writes (copies of GPU tensors) may hold; capture waits at the cap"),
        metavar="SIZE", size=True))
    batch_row: int | None = _option(None, Flag(("--batch-row",), (
        "Record only row N of tensors whose leading dimension is the batch size (one sequence of a batch, to "
        "compare with it scored alone)"), metavar="N", minimum=0))
    graph_budget_bytes: int = _option(1 << 30, Flag(("--graph-budget",), (
        "GPU memory for the static buffers that record tensors inside CUDA graphs; past it, the rest of a "
        "graph is recorded as statistics (see docs/GPU.md)"), metavar="SIZE", size=True))
    force: bool = _option(False, Flag(("--force",), (
        "Replace a dump in --out that holds records (one that holds none, from a failed run, is replaced "
        "anyway); never one that another capture is still writing")))
    shard_bytes: int = _option(512 << 20, None, "The size a shard is cut at (Python only: tests and benchmarks "
                                                  "make many shards with it)")

    def __post_init__(self) -> None:
        for name in ("select", "exclude", "ops"):   # one pattern, or several
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        for name in ("layers", "steps"):
            object.__setattr__(self, name, _ranges_as_given(getattr(self, name)))
        if self.mode not in MODES:
            raise TdiffError(f"--mode {self.mode!r}: use one of {', '.join(MODES)}")
        if self.storage not in STORAGES:
            raise TdiffError(f"--format {self.storage!r}: use one of {', '.join(STORAGES)}")
        if self.batch_row is not None and self.batch_row < 0:
            raise TdiffError(f"--batch-row must not be negative, not {self.batch_row}")
        if self.graph_budget_bytes < 0:
            raise TdiffError(f"--graph-budget must not be negative, not {self.graph_budget_bytes}")
        compile_patterns(self.select, "--select")
        compile_patterns(self.exclude, "--exclude")
        compile_patterns(self.ops, "--ops")
        self.layer_set()
        self.step_set()

    def layer_set(self) -> frozenset[int] | None:
        """The decoder layers recorded (None: all)."""
        return _range_set(self.layers, "--layers")

    def step_set(self) -> frozenset[int] | None:
        """The steps recorded (None: all)."""
        return _range_set(self.steps, "--steps")

    def side_of(self, out) -> str:
        """The label of a capture into directory ``out``."""
        return self.side or out.name

    def to_json(self) -> dict:
        """Every field by its name: what a command hands its processes (tdiff.launch)."""
        return {f.name: list(value) if isinstance(value := getattr(self, f.name), tuple) else value
                for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, payload: dict) -> CaptureOptions:
        return cls(**payload)


def flags(names: Iterable[str] = ()) -> Iterator[tuple[dataclasses.Field, Flag]]:
    """The fields named (every field that has a flag, when none is), each with its flag, in the
    order they are declared (``tdiff capture --help`` lists them so)."""
    wanted = set(names)
    for option in dataclasses.fields(CaptureOptions):
        flag = option.metadata["flag"]
        if flag is not None and (not wanted or option.name in wanted):
            yield option, flag


def options_doc(indent: str) -> str:
    """Each option by name, with its default, its flag and what it does: a docstring's list."""
    lines = []
    for option in dataclasses.fields(CaptureOptions):
        flag = option.metadata["flag"]
        spelling = f" ({flag.name})" if flag is not None else ""
        lines.append(textwrap.fill(f"{option.name}={option.default!r}{spelling}: {option.metadata['doc']}.",
                                   width=100, initial_indent=indent, subsequent_indent=indent + "    "))
    return "\n".join(lines)


def _ranges_as_given(value):
    if value is None or isinstance(value, (str, int)):
        return value
    return tuple(sorted(int(v) for v in value))


def _range_set(value, what: str) -> frozenset[int] | None:
    if value is None or isinstance(value, str):
        return parse_ranges(value, what)
    if isinstance(value, int):
        return frozenset([value])
    return frozenset(value)


DEFAULTS = CaptureOptions()
