"""Running each side's command under capture, one run at a time, and the log of why.

Every run is one execution of a side's command with a capture configured for one purpose (the
stats pass, a probe of one boundary, the full capture of the narrowed region, a graft). The log
is what `tdiff bisect` prints: how many runs each side took, and why each one was made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tdiff.capture_options import CaptureOptions
from tdiff.errors import DumpError, TdiffError
from tdiff.launch import CaptureConfig, GraftSpec, failure, run_command
from tdiff.store import Dump, open_dump

SIDES = ("A", "B")


@dataclass
class Run:
    side: str
    number: int          # per side, from 1
    purpose: str         # "stats pass", "discovery", "probe", "final capture", "ops", "graft"
    why: str
    path: Path
    outcome: str = ""    # filled in once the run has been judged

    @property
    def label(self) -> str:
        return f"{self.side}{self.number}"

    def to_json(self) -> dict:
        return {"side": self.side, "number": self.number, "purpose": self.purpose, "why": self.why,
                "outcome": self.outcome, "path": str(self.path)}

    @classmethod
    def from_json(cls, data: dict) -> Run:
        return cls(side=data["side"], number=data["number"], purpose=data["purpose"], why=data["why"],
                   path=Path(data["path"]), outcome=data["outcome"])


@dataclass
class RunLog:
    runs: list[Run] = field(default_factory=list)
    boundaries: int | None = None   # boundaries a binary search ran over (None: no search)
    strategy: str = ""

    def count(self, side: str) -> int:
        return sum(1 for run in self.runs if run.side == side)

    def summary(self) -> str:
        counts = ", ".join(f"{side} {self.count(side)}" for side in SIDES)
        return f"runs: {counts} ({self.strategy})"

    def to_json(self) -> dict:
        return {"a": self.count("A"), "b": self.count("B"), "strategy": self.strategy,
                "boundaries": self.boundaries, "log": [run.to_json() for run in self.runs]}

    @classmethod
    def from_json(cls, data: dict) -> RunLog:
        return cls(runs=[Run.from_json(run) for run in data["log"]], boundaries=data["boundaries"],
                   strategy=data["strategy"])


class Runner:
    """Runs ``commands[side]`` (a shell command line) under capture into ``work``."""

    def __init__(self, commands: dict[str, str], work: Path, echo: Callable[[str], None]):
        self.commands = commands
        self.work = Path(work)
        self.echo = echo
        self.log = RunLog()

    def capture(self, side: str, purpose: str, why: str, *, graft: GraftSpec | None = None,
                **options) -> tuple[Run, Dump]:
        """One run of ``side``'s command, captured with ``options`` (tdiff.capture_options)."""
        number = self.log.count(side) + 1
        name = f"{side.lower()}{number}-{purpose.replace(' ', '-')}"
        run = Run(side, number, purpose, why, self.work / name)
        self.log.runs.append(run)
        self.echo(f"run {run.label} ({purpose}): {why}")
        config = CaptureConfig(out=run.path, options=CaptureOptions(side=f"{side}{number}", **options), graft=graft)
        output = self.work / f"{name}.log"
        returncode = run_command(["/bin/sh", "-c", self.commands[side]], capture=config, log=output)
        if returncode != 0:
            raise TdiffError(f"run {run.label} ({purpose}) failed: {failure(returncode, output)}; "
                             f"its output is in {output}")
        try:
            return run, open_dump(run.path)
        except DumpError as exc:
            raise TdiffError(f"run {run.label} ({purpose}) captured nothing usable: {exc}") from None
