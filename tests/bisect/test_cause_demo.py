"""The README demo through the real CLI: `tdiff capture --params` per side, then `tdiff bisect`
states both sides' distance from the exact RMSNorm, figures checked against the tensors."""

import json
import math

import pytest

from examples.demo.run import PLANTED_MODULE, build_model
from tdiff.bisect.cause import CORRECTLY_ROUNDED, LOSSY_SHARE, ROUNDING_ULPS
from tdiff.store import open_dump
from tests.bisect.exact import exact_rms_norm, nearest_bf16
from tests.helpers import DEMO, tdiff_cli, tdiff_process


@pytest.mark.slow
def test_the_demo_bisect_states_both_sides_figures_against_the_exact_rmsnorm(tmp_path):
    for side, planted in (("a", []), ("b", ["--planted"])):
        done = tdiff_process("capture", "--out", tmp_path / side, "--params", "--", "python", DEMO, *planted)
        assert done.returncode == 0, done.stderr
    found = tdiff_cli("bisect", tmp_path / "a", tmp_path / "b", "--json", expect=1)
    first = json.loads(found.output)["first_divergence"]
    assert first["module"] == PLANTED_MODULE
    cause = first["cause"]
    assert (cause["reference"], cause["op"]) == ("float64", "RMSNorm")

    # the figures, from the tensors: the exact RMSNorm of each side's recorded input, with the
    # model's own weight and eps (the demo builds it seeded), against each side's recorded output
    norm = build_model().get_submodule(PLANTED_MODULE)
    share, ulps = {}, {}
    for side in ("a", "b"):
        dump = open_dump(tmp_path / side)
        call = {r.role: dump.load(r) for r in dump.records
                if r.module == PLANTED_MODULE and r.step == 0 and r.call == 0 and r.role in ("input", "output")}
        exact = exact_rms_norm(call["input"], norm.weight.detach(), norm.variance_epsilon)
        share[side] = float((call["output"] == nearest_bf16(exact)).double().mean())
        spacing = math.ldexp(1.0, math.frexp(float(exact.abs().max()))[1] - 8)   # bf16's ULP there
        ulps[side] = float((call["output"].double() - exact).abs().max()) / spacing
    assert cause["equal_a"] == pytest.approx(share["a"]) and cause["equal_b"] == pytest.approx(share["b"])
    assert cause["ulp_a"] == pytest.approx(ulps["a"]) and cause["ulp_b"] == pytest.approx(ulps["b"])
    # whatever the class, it follows from these figures
    if max(ulps.values()) <= ROUNDING_ULPS:
        lossy = [s for s, other in (("a", "b"), ("b", "a"))
                 if share[other] >= CORRECTLY_ROUNDED and share[s] < LOSSY_SHARE]
        expected = ("precision", lossy[0]) if len(lossy) == 1 else ("rounding", None)
        assert (cause["class"], cause["side"]) == expected

    # the swap: side B's norm, rebuilt from its class, is HF's unpatched one: it does not give B's
    # output, and says so; side A's on side B's (identical) inputs gives A's output
    swap = first["swap"]
    assert "does not reproduce its own output" in swap["b_on_a"]["problem"]
    assert (swap["a_on_b"]["equals_own"], swap["a_on_b"]["equals_other"]) == (True, False)

    line = next(line for line in tdiff_cli("bisect", tmp_path / "a", tmp_path / "b").output.splitlines()
                if "cause:" in line)
    assert f"side A equals the exact RMSNorm correctly rounded in {_percent(share['a'])}" in line
    assert f"side B in {_percent(share['b'])}" in line
    report = tdiff_cli("report", tmp_path / "a", tmp_path / "b", "--bisect").output
    assert f"**Cause:** {cause['class']}" in report and _percent(share["b"]) in report


def _percent(share: float) -> str:
    return "100%" if share == 1 else f"{math.floor(share * 1000) / 10:.1f}%"

