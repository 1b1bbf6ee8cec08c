"""A parity gate for CI: assert that two dumps match, the way slime's train/rollout gates do.

    from tdiff.testing import assert_match

    assert_match("dumps/engine", "dumps/trainer", layers="0-5")        # every element bitwise equal
    assert_match("dumps/engine", "dumps/trainer", select="logprobs", atol=1e-6)

A divergence raises AssertionError whose message is bisect's summary (the op that introduces it,
its kind, layer and metrics). Bad input (a dump that cannot be read, an incomplete dump, filters
that leave nothing to compare) raises :class:`tdiff.TdiffError`, so an empty or partial dump never
passes. The pytest plugin (:mod:`tdiff.testing.pytest_plugin`) adds the fixture ``tdiff_capture``.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import TYPE_CHECKING

from tdiff.errors import TdiffError

if TYPE_CHECKING:
    from tdiff.store import Dump


def assert_match(dump_a: Dump | str | Path, dump_b: Dump | str | Path, *, layers: str | None = None,
                 select: str | None = None, atol: float = 0.0, rtol: float = 0.0, ulp: float | None = None,
                 allow_unaligned: bool = False) -> None:
    """Raise AssertionError (message: bisect's summary) unless dump B matches dump A.

    Dumps are paired as ``tdiff bisect A B`` pairs them (by name, by canonical boundary across
    frameworks and layouts). ``layers``: only tensors of these decoder layers ("0-5", "0,3");
    ``select``: only tensors whose name matches this regex. Bitwise unless ``atol`` or ``rtol`` is
    given: then an element matches when ``|a-b| <= atol + rtol * max(|a|, |b|)``; ``ulp=N`` adds N
    ULPs at each tensor's scale (``tdiff compare --ulp``). Runs aligned by token whose rows of tokens
    both fed were not all compared raise TdiffError, unless ``allow_unaligned`` (docs/ALIGNMENT.md).
    """
    from tdiff.align import choose_pairing
    from tdiff.bisect import bisect_dumps
    from tdiff.compare.metrics import EXACT, Tolerance
    from tdiff.compare.pairing import NameFilter
    from tdiff.report.console import make_console, render_bisect
    from tdiff.store import Dump, open_dump
    from tdiff.text import printable

    for name, value in (("atol", atol), ("rtol", rtol), ("ulp", 0.0 if ulp is None else ulp)):
        if not 0 <= value < math.inf:
            raise TdiffError(f"assert_match: {name} must be a non-negative number, not {value}")
    tolerance = EXACT if atol == 0 and rtol == 0 and ulp is None else Tolerance(atol=atol or None, rtol=rtol or None, ulp=ulp)
    a = dump_a if isinstance(dump_a, Dump) else open_dump(dump_a)
    b = dump_b if isinstance(dump_b, Dump) else open_dump(dump_b)
    names = NameFilter.of([select] if select is not None else [], layers=layers)   # layers None, "", "all": every one
    pairing = names.applied_to(choose_pairing(a, b))
    result = bisect_dumps(a, b, tolerance=tolerance, pairing=pairing, allow_unaligned=allow_unaligned)
    if result.exit_code != 0:
        console = make_console()
        console.file = io.StringIO()
        console.width = 200
        # the verdict first (a test report shows the message's first line), then what bisect notes
        notes, result.notes = result.notes, []
        render_bisect(result, console)
        for note in notes:
            console.print(f"note: {printable(note)}", markup=False, soft_wrap=True)
        raise AssertionError(console.file.getvalue().rstrip())


__all__ = ["assert_match"]
