"""Which side is right: the culprit's canonical op replayed exactly on each side, and a class.

For a culprit that is one module call (event ``output``), each side's call is replayed in float64
on that side's own recorded inputs, with its own parameters and settings (tdiff.bisect.reference),
and each side's output is measured against that exact result: its largest distance in ULPs of the
output's dtype at the tensor's scale (the largest |exact|), and the share of its elements equal to
the exact result correctly rounded to that dtype. Then:

- ``inherited``: the two sides' inputs differ beyond the tolerance (the culprit is upstream), or
  the first differing event is an input whose producer was not recorded;
- ``logic``: the settings or parameters the op reads differ and give other exact results
  (``eps 1e-06 vs 0.1``), or one side is further from its exact result than any float format's
  rounding explains (more than LOGIC_RELATIVE of the tensor's scale): its op is another one
  (where both are, the module computes another op than the canonical one: ``unknown``);
- ``rounding``: both sides within ROUNDING_ULPS of it (accumulation order, kernel choice);
- ``precision``: one side within rounding, the other beyond it (a lower-precision step), named;
  or both within a few ULPs, one correctly rounded (CORRECTLY_ROUNDED of the elements) and the
  other visibly not (under LOSSY_SHARE): the other rounds an intermediate step more coarsely;
- ``unknown``: no canonical op for this boundary, or what it needs was not recorded (said).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tdiff.bisect.reference import NoReplay, Replay, correctly_rounded, replay_for, residual_add
from tdiff.bisect.result import Cause, Divergence
from tdiff.compare.metrics import Tolerance, compare_tensors, ulp_at
from tdiff.errors import DumpError
from tdiff.store import Dump, Record
from tdiff.store.modules import load_param, read_module_descriptions

ROUNDING_ULPS = 4.0        # at the tensor's scale: what accumulation order and kernel choice move
LOGIC_RELATIVE = 2.0 ** -3  # of the tensor's scale: past the rounding of any float format down to FP8
# A side that equals the correctly rounded exact result in CORRECTLY_ROUNDED of the elements shows
# that the op can be had at this dtype; the other side, within a few ULPs but correctly rounded in
# less than LOSSY_SHARE of them, rounds an intermediate step more coarsely (fp32 accumulation-order
# differences flip a bf16 rounding in about one element in 2^15, not in one in ten).
CORRECTLY_ROUNDED = 0.99
LOSSY_SHARE = 0.9


@dataclass
class Distance:
    """One side's output against its exact result."""

    ulp: float          # max |output - exact| in ULPs of the output's dtype at max |exact|
    relative: float     # max |output - exact| / max |exact|
    equal: float        # share of elements equal to the exact result correctly rounded
    dtype: torch.dtype


def cause_of(a: Dump, b: Dump, divergence: Divergence, tolerance: Tolerance) -> Cause:
    """The cause of ``divergence`` (found by bisect on dumps ``a`` and ``b``)."""
    if divergence.event == "input" and not divergence.introduced:
        return Cause.found("inherited", None, description=(
            f"the inputs of `{divergence.module}` already differ and their producer was not recorded: "
            "the divergence is inherited from upstream"))
    if divergence.event not in ("output", "between") or divergence.first is None:
        return Cause.found("unknown", None, description="no exact replay: the culprit is not one module call")
    first = divergence.first
    if first.a is None or first.b is None:
        return Cause.found("unknown", None, description="no exact replay: the culprit's output is on one side only")
    replays = []
    for side, dump, record, module in (("A", a, first.a, divergence.module), ("B", b, first.b, divergence.module_b)):
        replay = _side_replay(dump, record, divergence.event, module, divergence.kind, divergence.op is not None)
        if isinstance(replay, NoReplay):
            where = f"`{module}`" if module else "the code outside any module"
            return Cause.found("unknown", None, description=f"no exact replay of {where} on side {side}: "
                                                            f"{replay.missing}")
        replays.append(replay)
    try:
        return _classify(replays[0], replays[1], divergence.module or "", tolerance)
    except (RuntimeError, ValueError, IndexError) as exc:   # recorded tensors the op cannot take together
        return Cause.found("unknown", None, op=replays[0].op, description=(
            f"no exact replay: the {replays[0].op} does not run on the recorded tensors ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"))


def _side_replay(dump: Dump, record: Record, event: str, module: str | None, kind: str,
                 op_named: bool) -> Replay | NoReplay:
    """One side's replay of the culprit, whose first differing tensor is ``record``: the module's
    call (event output); for code of ``module``'s own forward (event between), that whole call
    where the module is a canonical op (its inputs matched, its output is what its code made),
    else a decoder layer's residual add."""
    if event == "output":
        return _replay(dump, record)
    if module is None:
        return NoReplay("the culprit is code outside any module")
    output = _enclosing_output(dump, record, module)
    replay = _replay(dump, output) if output is not None else NoReplay(f"the output of `{module}` was not recorded")
    if isinstance(replay, NoReplay) and kind == "residual":
        return _residual_replay(dump, record)
    if isinstance(replay, NoReplay):
        hint = "its op records name the op" if op_named else "capture its ops with --ops to name the op"
        replay = NoReplay(f"{replay.missing}; the culprit is code of its own forward between two recorded events "
                          f"({hint})")
    return replay


def _enclosing_output(dump: Dump, record: Record, module: str) -> Record | None:
    """The first output of ``module``'s call that encloses ``record`` (or is it)."""
    return next((r for r in dump.records if r.module == module and r.role == "output" and r.rank == record.rank
                 and r.step == record.step and r.part == record.part and r.seq >= record.seq), None)


def _replay(dump: Dump, output: Record) -> Replay | NoReplay:
    """The replay of the call that made ``output``, with that call's recorded tensors."""
    call = [r for r in dump.records if r.module == output.module and r.step == output.step
            and r.call == output.call and r.rank == output.rank and r.part == output.part
            and r.role in ("input", "output")]
    if any(not r.has_data for r in call):
        return NoReplay("it was captured in stats mode (no tensors); capture it in full mode")
    try:
        inputs = {r.sub: dump.load(r) for r in call if r.role == "input"}
        outputs = {r.sub: dump.load(r) for r in call if r.role == "output"}
        description = read_module_descriptions(dump.path).get((output.rank, output.module))

        def load(name: str) -> torch.Tensor:
            assert description is not None and description.params is not None
            return load_param(dump.path, description.params[name])

        return replay_for(description, inputs, outputs, load)
    except DumpError as exc:
        return NoReplay(str(exc))


def _residual_replay(dump: Dump, result: Record) -> Replay | NoReplay:
    """The residual add of a pre-norm decoder layer, the code that made ``result`` (the first
    differing tensor: the next child's input, or the layer's output): the output of the child just
    before it (attention, MLP) plus the residual stream, which is the input of the child called
    before that one (the norm that fed it): ``h + attn(norm(h))``."""
    parent = result.parent if result.role == "input" else result.module
    same_process = [r for r in dump.records if r.rank == result.rank and r.step == result.step
                    and r.part == result.part and r.seq < result.seq]
    siblings = [r for r in same_process if r.parent == parent and r.module != result.module]
    start = max((r.seq for r in same_process if r.module == parent and r.role == "input"), default=-1)
    siblings = [r for r in siblings if r.seq > start]   # this call of the layer only
    outputs = [r for r in siblings if r.role == "output"]
    if not outputs:
        return NoReplay("no child output precedes it in this call: no residual add to replay")
    last = outputs[-1].module
    branch = next((r for r in outputs if r.module == last), None)
    earlier = [r for r in siblings if r.role == "input" and r.module != last
               and r.seq < min(s.seq for s in siblings if s.module == last)]
    if branch is None or not earlier:
        return NoReplay(f"no child was called before `{last}` in this call: the residual stream is not recorded")
    norm_input = next(r for r in earlier if r.module == earlier[-1].module)   # that child's first input
    if any(not r.has_data for r in (branch, norm_input, result)):
        return NoReplay("it was captured in stats mode (no tensors); capture it in full mode")
    try:
        x, residual, out = dump.load(branch), dump.load(norm_input), dump.load(result)
    except DumpError as exc:
        return NoReplay(str(exc))
    if not (x.shape == residual.shape == out.shape) or not out.is_floating_point():
        return NoReplay(f"`{last}`'s output {list(x.shape)}, the residual {list(residual.shape)} and the result "
                        f"{list(out.shape)} are not one residual add")
    return Replay("residual add", {"residual": residual, last: x}, {result.name: out}, {}, {},
                  lambda: {result.name: residual_add(_as_f64(residual), _as_f64(x))})


def _as_f64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def _classify(replay_a: Replay, replay_b: Replay, module: str, tolerance: Tolerance) -> Cause:
    op = replay_a.op if replay_a.op == replay_b.op else f"{replay_a.op} / {replay_b.op}"
    differing_inputs = _differing_inputs(replay_a, replay_b, tolerance)
    if differing_inputs is not None:
        return Cause.found("inherited", None, op=op, description=(
            f"the inputs of `{module}`'s {op} differ ({differing_inputs}): the divergence is inherited "
            "from upstream"))
    exact_a, exact_b = replay_a.compute(), replay_b.compute()
    da, db = _distance(replay_a, exact_a), _distance(replay_b, exact_b)
    figures = (f"side A equals the exact {op} correctly rounded in {_percent(da.equal)} of elements "
               f"({_ulps(da.ulp)} at scale), side B in {_percent(db.equal)} ({_ulps(db.ulp)})")
    found: dict[str, Any] = dict(op=op, ulp_a=da.ulp, ulp_b=db.ulp, equal_a=da.equal, equal_b=db.equal)
    differing = _differing_settings(replay_a, replay_b)
    if differing and _exact_results_differ(replay_a, exact_a, replay_b, exact_b):
        telling = _single([side for side, d in (("a", da), ("b", db)) if d.ulp > ROUNDING_ULPS])
        tells = (f"side {telling.upper()} is also beyond rounding of its own exact result" if telling
                 else "nothing recorded tells which is the intended one")
        return Cause.found("logic", telling, differing=differing, **found, description=(
            f"the sides run different {op}s: {', '.join(differing)} ({tells}); {figures}"))
    beyond = [side for side, d in (("a", da), ("b", db)) if d.relative > LOGIC_RELATIVE]
    if len(beyond) == 2:   # the module computes another op than this canonical one (a (1 + weight) norm)
        return Cause.found("unknown", None, op=op, description=(
            f"no exact replay: neither side's result is a {op} of its recorded tensors ({figures})"))
    if beyond:
        side = beyond[0]
        return Cause.found("logic", side, **found, description=(
            f"{figures}: side {side.upper()} departs from the {op} by more than any precision loss explains "
            f"(over {LOGIC_RELATIVE:.3g} of the tensor's scale): another formula, setting or positions"))
    lossy = [side for side, d in (("a", da), ("b", db)) if d.ulp > ROUNDING_ULPS]
    if not lossy:  # within a few ULPs both, but one rounds correctly and the other visibly does not
        lossy = [side for side, d, other in (("a", da, db), ("b", db, da))
                 if other.equal >= CORRECTLY_ROUNDED and d.equal < LOSSY_SHARE]
    if not lossy:
        return Cause.found("rounding", None, **found, description=(
            f"{figures}: both within rounding of it: accumulation order or kernel choice "
            "(try deterministic / batch-invariant kernels)"))
    losing = _single(lossy)
    who = f"{losing.upper()} loses precision" if losing else "both lose precision"
    return Cause.found("precision", losing, **found, description=f"{figures}: {who}")


def _differing_inputs(replay_a: Replay, replay_b: Replay, tolerance: Tolerance) -> str | None:
    """What differs between the inputs the two replays read (None: nothing beyond ``tolerance``)."""
    for (sub, ta), (_, tb) in zip(replay_a.inputs.items(), replay_b.inputs.items()):
        if ta.shape != tb.shape:
            return f"input {sub or '0'} has shape {list(ta.shape)} on side A, {list(tb.shape)} on side B"
        if not compare_tensors(ta, tb, tolerance).within(tolerance):
            return f"input {sub or '0'} differs beyond {tolerance.describe()}"
    return None


def _differing_settings(replay_a: Replay, replay_b: Replay) -> list[str]:
    settings = [f"{name} {replay_a.settings.get(name)} vs {replay_b.settings.get(name)}"
                for name in dict.fromkeys([*replay_a.settings, *replay_b.settings])
                if replay_a.settings.get(name) != replay_b.settings.get(name)]
    params = [f"{name} differs" for name in dict.fromkeys([*replay_a.params, *replay_b.params])
              if replay_a.params.get(name) != replay_b.params.get(name)]
    return settings + params


def _exact_results_differ(replay_a: Replay, exact_a: dict, replay_b: Replay, exact_b: dict) -> bool:
    """Whether the two sides' exact results, each rounded to its output's dtype, differ anywhere."""
    for (sub_a, ea), (sub_b, eb) in zip(exact_a.items(), exact_b.items()):
        out_a, out_b = replay_a.outputs[sub_a], replay_b.outputs[sub_b]
        if ea.shape != eb.shape or not torch.equal(correctly_rounded(ea, out_a.dtype),
                                                   correctly_rounded(eb, out_b.dtype)):
            return True
    return False


def _distance(replay: Replay, exact: dict[str, torch.Tensor]) -> Distance:
    ulp, relative, equal, total = 0.0, 0.0, 0, 0
    dtype = torch.float64
    for sub, value in exact.items():
        output = replay.outputs[sub]
        dtype = output.dtype
        exact_value = value.reshape(output.shape)
        got = output.to(torch.float64)
        error = (got - exact_value).abs()
        both_nan = got.isnan() & exact_value.isnan()
        error = torch.where(both_nan, 0.0, torch.nan_to_num(error, nan=math.inf))
        finite = exact_value[exact_value.isfinite()]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
        worst = float(error.max()) if error.numel() else 0.0
        ulp = max(ulp, worst / ulp_at(scale, dtype))
        relative = max(relative, worst / scale if scale else (0.0 if worst == 0 else math.inf))
        rounded = correctly_rounded(exact_value, dtype)
        equal += int(((output == rounded) | (output.isnan() & rounded.isnan())).sum())
        total += output.numel()
    return Distance(ulp=ulp, relative=relative, equal=equal / total if total else 1.0, dtype=dtype)


def _single(sides: list[str]) -> str | None:
    return sides[0] if len(sides) == 1 else None


def _percent(share: float) -> str:
    """A share as a percentage that never rounds up to 100% (nor down to 0%) when it is not."""
    if share >= 1.0:
        return "100%"
    tenths = math.floor(share * 1000) / 10
    if tenths == 0 and share > 0:
        return "<0.1%"
    return f"{tenths:.1f}%"


def _ulps(ulp: float) -> str:
    return f"max {ulp:.3g} ULP" if math.isfinite(ulp) else "non-finite where it is finite"
