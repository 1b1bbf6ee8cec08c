"""Graft: rerun side B with the suspect module's inputs taken from side A, then compare outputs.

The culprit module of a divergence (the module itself for an "output" event, the forward whose
own code is suspected for a "between" event) is rerun on side B under a capture whose graft
option (tdiff.hooks.graft) feeds it side A's recorded inputs. Its inputs must then match A's
bitwise (that proves the graft took effect); its output decides:

- ``op_differs``: the output still differs on identical inputs: the op itself differs;
- ``inputs_only``: the output matches: it only passed on a difference in its inputs (under a
  tolerance, a small input difference it amplified), so it did not introduce the divergence.

Same-framework runs share module paths and input layouts. Between frameworks, A's inputs must be
laid out as B's first; that plan belongs to cross-framework alignment (tdiff.align) and is not
done here: a target whose paths differ between the sides is refused with a message.
"""

from __future__ import annotations

import re

from tdiff.bisect.result import BisectResult, Divergence, GraftVerdict, Metrics
from tdiff.bisect.runs import Runner
from tdiff.bisect.verdict import EventComparator
from tdiff.compare.metrics import EXACT, Tolerance
from tdiff.compare.pairing import NamePairing
from tdiff.errors import TdiffError
from tdiff.launch import GraftSpec
from tdiff.store import Dump
from tdiff.vocab.paths import ROOT_LABEL


def graft_target(divergence: Divergence) -> tuple[str, str, int]:
    """(module on A, module on B, call index) to rerun on A's inputs."""
    if divergence.module is None or divergence.module_b is None or divergence.module_call is None:
        raise TdiffError(f"--graft needs a module to rerun, and the divergence is not inside one: "
                         f"{divergence.description}")
    return divergence.module, divergence.module_b, divergence.module_call


def run_graft(runner: Runner, a: Dump, result: BisectResult, tolerance: Tolerance) -> GraftVerdict:
    """Rerun side B with the culprit's inputs from dump ``a``; attach and return the verdict."""
    divergence = result.first_divergence
    module, module_b, call = graft_target(divergence)
    if module != module_b:
        raise TdiffError(f"--graft across different module paths (`{module}` on A, `{module_b}` on B) "
                         "needs A's inputs laid out as B's (cross-framework alignment), which this "
                         "version cannot do")
    step = divergence.step
    inputs = [r for r in a.records
              if r.role == "input" and r.module == module and r.step == step and r.call == call]
    if not inputs:
        raise TdiffError(f"--graft needs side A's inputs of `{module or ROOT_LABEL}` (step {step} call "
                         f"{call}); {a.path} has none")
    if not all(r.has_data for r in inputs):
        raise TdiffError(f"--graft needs side A's inputs as tensors, and {a.path} was captured in stats "
                         "mode; capture side A with --mode full")
    spec = GraftSpec(dump=str(a.path.resolve()), module=module, module_b=module_b, step=step, call=call)
    run, b = runner.capture("B", "graft", f"`{module_b or ROOT_LABEL}` on side A's recorded inputs",
                            mode="full", select=[f"^{re.escape(module_b)}$"], steps=str(step),
                            graft=spec)
    pairs = [p for p in NamePairing().pair(a, b)
             if p.b is not None and p.record.module == module and p.record.step == step
             and p.record.call == call and p.record.role in ("input", "output")]
    exact = EventComparator(a, b, EXACT)
    for pair in pairs:
        if pair.record.role == "input" and (pair.a is None or exact.compare(pair).diverged):
            raise TdiffError(f"the graft did not take effect: input {pair.name} of the rerun still "
                             "differs from side A's")
    judge = EventComparator(a, b, tolerance)
    outputs = [judge.compare(p) for p in pairs if p.record.role == "output" and p.a is not None]
    if not outputs:
        raise TdiffError(f"the graft run recorded no output of `{module_b or ROOT_LABEL}`")
    differing = next((c for c in outputs if c.diverged), None)
    verdict = GraftVerdict(module=module, module_b=module_b, step=step, call=call,
                           verdict="op_differs" if differing else "inputs_only",
                           metrics=Metrics.of(differing or outputs[0]), run=str(run.path))
    run.outcome = verdict.verdict
    result.graft = verdict
    if verdict.verdict == "inputs_only":
        divergence.introduced = False
    return verdict
