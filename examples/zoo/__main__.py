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
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from examples.zoo.classes import CLASSES, by_key
from examples.zoo.runner import ZooError, markdown, run_class


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
