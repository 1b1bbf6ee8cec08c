"""The divergence zoo: every class of the DeepSeek-V4 true-on-policy work, planted in a tiny model on
an engine side against a trainer side, each found with `tdiff capture` (once per side) and
`tdiff bisect --json`. Prints the table docs/ZOO.md shows.

    python -m examples.zoo                        # every class
    python -m examples.zoo norm-tree qk-norm      # some
    python -m examples.zoo --out zoo-out --json zoo.json

Exit status 0 when every class ran (whatever bisect said: the table says it), 2 when a command
failed.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from examples.zoo.classes import CLASSES, ZooClass, by_key

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
        options = " ".join(shlex.quote(word) for word in trainer[2:trainer.index("--out")])
        extra = [word for word in engine[:engine.index("--out")] if word not in trainer]
        engine_only = f" (engine: `{' '.join(extra)}`)" if extra else ""
        return f"{len(self.commands)}: `tdiff capture {options}` per side{engine_only}, `tdiff bisect --json`"


HEADER = ["class", "planted where (engine side)", "named by bisect (module (kind) / op, token)", "cause class",
          "as planted", "commands used"]


def _capture(zoo_class: ZooClass, side: str, out: Path) -> list[str]:
    command = ["tdiff", "capture", "-q", "--force", "--params"]
    if zoo_class.ops:
        command += ["--ops", f"^{zoo_class.ops}$"]
    if side == "engine" and zoo_class.engine_batch > 1:
        command += ["--batch-row", "0"]
    return [*command, "--out", str(out / side), "--", "python", "-m", "examples.zoo.side", zoo_class.key, side]


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
    if op.get("parted"):
        return f"ops part: {op.get('name')} ({op.get('function')}) vs {op.get('name_b')} ({op.get('function_b')})"
    return f"{op.get('name')} ({op.get('function')})"


def run_class(zoo_class: ZooClass, out: Path) -> Row:
    """Capture both sides of ``zoo_class`` into ``out`` and bisect them."""
    captures = [_capture(zoo_class, side, out) for side in ("trainer", "engine")]
    for command in captures:
        _run(command, (0,))
    bisect = ["tdiff", "bisect", str(out / "trainer"), str(out / "engine"), "--json"]
    result = json.loads(_run(bisect, (0, 1)).stdout)
    commands = [shlex.join(c).replace(str(out) + "/", "") for c in captures]
    commands.append(shlex.join(bisect).replace(str(out) + "/", ""))
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
        problems.append(f"named `{module}`, not the planted `{zoo_class.named.replace(chr(92), '')}`")
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("classes", nargs="*", help=f"zoo classes (default: all): {', '.join(c.key for c in CLASSES)}")
    parser.add_argument("--out", type=Path, help="keep the dumps here (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    try:
        chosen = [by_key(key) for key in args.classes] or list(CLASSES)
    except KeyError as exc:
        parser.error(str(exc.args[0]))
    with tempfile.TemporaryDirectory(prefix="tdiff-zoo-") as scratch:
        out = args.out or Path(scratch)
        rows = []
        for zoo_class in chosen:
            print(f"zoo: {zoo_class.key} ...", file=sys.stderr, flush=True)
            try:
                rows.append(run_class(zoo_class, out / zoo_class.key))
            except ZooError as exc:
                print(f"zoo: {zoo_class.key}: {exc}", file=sys.stderr)
                return 2
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
