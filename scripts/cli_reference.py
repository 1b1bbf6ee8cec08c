"""Write the CLI reference section of README.md from the commands' own --help.

    python scripts/cli_reference.py          # rewrite README.md
    python scripts/cli_reference.py --check  # exit 1 when README.md is out of date (tests do this)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from click.testing import CliRunner

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- cli-reference:begin -->", "<!-- cli-reference:end -->"


def help_text(args: list[str]) -> str:
    from tdiff.cli import cli

    result = CliRunner(env={"COLUMNS": "100"}).invoke(cli, [*args, "--help"], prog_name="tdiff", terminal_width=100)
    return result.output.rstrip()


def reference() -> str:
    from tdiff.cli import COMMANDS, LazyGroup

    sections = ["```\n$ tdiff --help\n" + help_text([]) + "\n```"]
    for name in COMMANDS:
        command = LazyGroup().get_command(None, name)
        subcommands = getattr(command, "commands", None)
        sections.append(f"### tdiff {name}\n\n```\n$ tdiff {name} --help\n{help_text([name])}\n```")
        for sub in sorted(subcommands or ()):
            sections.append(f"```\n$ tdiff {name} {sub} --help\n{help_text([name, sub])}\n```")
    return "\n\n".join(sections)


def updated(text: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
    return pattern.sub(lambda _: f"{BEGIN}\n{reference()}\n{END}", text)


def main() -> int:
    text = README.read_text()
    new = updated(text)
    if "--check" in sys.argv:
        if new != text:
            print("README.md's CLI reference is out of date: run python scripts/cli_reference.py")
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
