"""Online bisection zooms into a module's own code: when the culprit is a module's own code and
the runs recorded no op records, rerun both commands recording that module's ATen ops, so that
one `tdiff bisect --run-a --run-b` names the op, its function and source line (tdiff.bisect.ops).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from tdiff.bisect.ops import attach, own_code, path_label
from tdiff.bisect.result import Divergence
from tdiff.bisect.runs import Runner
from tdiff.bisect.walk import bisect_dumps
from tdiff.compare.metrics import Tolerance
from tdiff.compare.pairing import Pairing
from tdiff.store import Dump


def zoom_in(runner: Runner, divergence: Divergence | None, tolerance: Tolerance,
            pairing_of: Callable[[Dump, Dump], Pairing]) -> list[str]:
    """Online: where the culprit is a module's own code, rerun both commands recording that
    module's ops (``--ops '^<module>$'``, only that module and its step) and name the op in
    ``divergence``; returns notes (the rerun no longer reproducing the divergence, say).
    ``pairing_of`` pairs the two reruns' captures.

    Bitwise, the reruns are stats captures (fingerprints name the op; the metrics stay those of
    the module-level verdict), so they store no tensor and --budget-gb is not at stake."""
    if divergence is None or divergence.op is not None or not own_code(divergence):
        return []
    pattern = f"^{re.escape(divergence.module or '')}$"
    why = f"the ops of `{path_label(divergence.module)}`'s own code (--ops {pattern})"
    step = str(divergence.step)
    mode = "stats" if tolerance.exact else "full"
    run_a, a = runner.capture("A", "ops", why, mode=mode, select=[pattern], steps=step, ops=[pattern])
    run_b, b = runner.capture("B", "ops", why, mode=mode, select=[pattern], steps=step, ops=[pattern])
    # with the module alone recorded, its output is the event; its call and ops are the culprit's
    # (what the runs left uncompared is the verdict's, judged on the captures that located the culprit)
    result = bisect_dumps(a, b, tolerance=tolerance, pairing=pairing_of(a, b), allow_unaligned=True)
    run_a.outcome = run_b.outcome = result.status
    zoomed = result.first_divergence
    if zoomed is None or zoomed.module != divergence.module or zoomed.op is None:
        return [(f"the rerun recording the ops of `{path_label(divergence.module)}` did not reproduce the "
                 "divergence there (the runs may not be repeatable: see tdiff capture --repeat); no op is named")]
    attach(divergence, zoomed.op)  # the kind of the module-level verdict, refined by the op's
    return []
