"""Run one zoo class: capture each side with `tdiff capture`, bisect them with `tdiff bisect --json`,
and judge what bisect named against where the class was planted (``judge``: computed from the
bisect JSON, never assumed)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from examples.zoo.classes import ZooClass

REPO = Path(__file__).resolve().parents[2]
SIDES = {"a": "trainer", "b": "engine"}     # bisect's side A is the trainer, B the engine


class ZooError(Exception):
    """A command of the zoo failed (not a verdict: the class could not be run)."""


@dataclass
class Row:
    key: str
    title: str
    planted: str               # where, and what
    named: str | None          # the module bisect named
    op: str | None             # the op inside it, where op records named one
    token: str | None
    kind: str | None
    cause: str | None          # "precision (engine)"
    cause_description: str | None
    commands: list[str]
    right: bool                # named at the planted module, with the expected cause
    why: str | None            # what differs from the expectation, where not right

    def cells(self) -> list[str]:
        named = "—" if self.named is None else f"`{self.named}` ({self.kind})"
        if self.op:
            named += f" / {self.op}"
        if self.token:
            named += f", {self.token}"
        verdict = "yes" if self.right else f"no: {self.why}"
        return [self.title, self.planted, named, self.cause or "—", verdict, self.commands_used()]

    def commands_used(self) -> str:
        """How many commands, and the capture's options (the full lines are in ``commands``)."""
        trainer, engine = (shlex.split(c) for c in self.commands[:2])
        options = " ".join(shlex.quote(word) for word in trainer[2:trainer.index("--out")] if word in engine)
        extra = [shlex.quote(word) for word in engine[:engine.index("--out")] if word not in trainer]
        engine_only = f" (engine: `{' '.join(extra)}`)" if extra else ""
        extra = [shlex.quote(word) for word in trainer[:trainer.index("--out")] if word not in engine]
        trainer_only = f" (trainer: `{' '.join(extra)}`)" if extra else ""
        launch = trainer[trainer.index("--") + 1:trainer.index("examples.zoo.side") - 1]
        under = f" under `torchrun {' '.join(launch[3:])}`" if "torch.distributed.run" in launch else ""
        return (f"{len(self.commands)}: `tdiff capture {options}` per side{engine_only}{trainer_only}{under}, "
                "`tdiff bisect --json`")


HEADER = ["class", "planted where (engine side)", "named by bisect (module (kind) / op, token)", "cause class",
          "as planted", "commands used"]


def _capture(zoo_class: ZooClass, side: str, out: Path) -> list[str]:
    command = ["tdiff", "capture", "-q", "--force", "--params"]
    if zoo_class.ops:
        command += ["--ops", f"^{zoo_class.ops}$"]
    if side == "trainer" and zoo_class.megatron_attention:   # its softmax and dropout, modules the engine lacks
        command += ["--exclude", r"\.attn\.(scale_mask_softmax|attention_dropout)"]
    if side == "engine" and zoo_class.engine_batch > 1:
        command += ["--batch-row", "0"]
    launch = ["python", "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={zoo_class.ranks}"] \
        if zoo_class.ranks > 1 else ["python"]
    return [*command, "--out", str(out / side), "--", *launch, "-m", "examples.zoo.side", zoo_class.key, side]


def _run(command: list[str], allowed: tuple[int, ...]) -> subprocess.CompletedProcess:
    """Run ``command`` from the repository root: `tdiff` is this tree's, `python` this interpreter."""
    argv = [sys.executable if word == "python" else word for word in command]
    if argv[0] == "tdiff":
        argv[:1] = [sys.executable, "-m", "tdiff"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if done.returncode not in allowed:
        raise ZooError(f"`{shlex.join(command)}` exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done


def _display(pattern: str) -> str:
    """A module pattern as the table shows it: ``\\d+`` as N, no escapes."""
    return pattern.replace("\\d+", "N").replace(".*", "*").replace("\\", "")


def _planted(zoo_class: ZooClass) -> str:
    engine = ", ".join(f"`{_display(p.module)}`" for p in zoo_class.engine)
    both = ", ".join(f"`{_display(p.module)}`" for p in zoo_class.both)
    where = engine or f"{both} (both sides)"
    return f"{where}: {zoo_class.note}"


def _token(token: dict | None) -> str | None:
    if token is None:
        return None
    return f"token {token['position']} of sequence {token['seq_a']}/{token['seq_b']}"


def _op(op: dict | None) -> str | None:
    if op is None:
        return None
    a = f"{op.get('name')} in {op.get('function')} ({op.get('source')})"
    if op.get("parted"):
        return f"op sequences part: {a} vs {op.get('name_b')} in {op.get('function_b')} ({op.get('source_b')})"
    return a


def run_class(zoo_class: ZooClass, out: Path) -> Row:
    """Capture both sides of ``zoo_class`` into ``out``, bisect them, and judge the result."""
    captures = [_capture(zoo_class, side, out) for side in ("trainer", "engine")]
    for command in captures:
        _run(command, (0,))
    bisect = ["tdiff", "bisect", str(out / "trainer"), str(out / "engine"), "--json"]
    result = json.loads(_run(bisect, (0, 1)).stdout)
    commands = [shlex.join(c).replace(str(out) + "/", "") for c in [*captures, bisect]]
    return judge(zoo_class, result, commands)


def judge(zoo_class: ZooClass, result: dict, commands: list[str]) -> Row:
    """The table's row for ``zoo_class`` from its bisect JSON ``result``."""
    first = result.get("first_divergence")
    if first is None:
        return Row(zoo_class.key, zoo_class.title, _planted(zoo_class), None, None, None, None, None, None, commands,
                   False, f"bisect found no divergence (status {result['status']}): the planted variant gives "
                          "the trainer's bits on this machine")
    cause = first.get("cause") or {}
    side = SIDES.get(cause.get("side") or "")
    cause_text = cause.get("class") and (f"{cause['class']} ({side})" if side else cause["class"])
    problems = []
    module = first.get("module")
    if module is None or not re.fullmatch(zoo_class.named, module):
        problems.append(f"named `{module}`, not the planted `{_display(zoo_class.named)}`")
    if cause.get("class") != zoo_class.cause or side != zoo_class.side:
        expected = f"{zoo_class.cause} ({zoo_class.side})" if zoo_class.side else zoo_class.cause
        problems.append(f"cause {cause_text}, expected {expected}: {cause.get('description')}")
    return Row(zoo_class.key, zoo_class.title, _planted(zoo_class), module, _op(first.get("op")),
               _token(first.get("token")), first.get("kind"), cause_text, cause.get("description"), commands,
               not problems, "; ".join(problems) or None)


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row.cells()) + " |" for row in rows]
    right = sum(row.right for row in rows)
    lines.append("")
    lines.append(f"{right} of {len(rows)} classes named at the planted module with the expected cause.")
    return "\n".join(lines)


