"""Which side is right: the culprit's canonical op replayed in float64 on each side's own inputs,
parameters and settings, on small real torch and transformers modules with known answers."""

import math
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import tdiff
from tdiff.bisect import BisectResult, bisect_dumps
from tdiff.bisect.cause import CORRECTLY_ROUNDED, LOGIC_RELATIVE, ROUNDING_ULPS
from tdiff.bisect.reference import correctly_rounded
from tests.bisect.exact import exact_rms_norm, nearest_bf16


class Wrapper(torch.nn.Module):
    """The op under test as the child `op`: bisect names it with event `output`."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, *args):
        return self.op(*args)


class RMSNorm(torch.nn.Module):
    """An RMSNorm written out, as frameworks do (the class name says what it is)."""

    def __init__(self, size, eps=1e-6, variance_dtype=torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, size))
        self.variance_epsilon = eps
        self.variance_dtype = variance_dtype

    def forward(self, x):
        h = x.float()
        variance = h.to(self.variance_dtype).pow(2).mean(-1, keepdim=True).float()
        return (self.weight * (h * torch.rsqrt(variance + self.variance_epsilon))).to(x.dtype)


def bisected(tmp_path, module_a, module_b, *inputs, params=True):
    for side, module, args in (("a", module_a, inputs), ("b", module_b, inputs)):
        with torch.no_grad(), tdiff.capture(tmp_path / side, params=params):
            Wrapper(module)(*args)
    return bisect_dumps(tmp_path / "a", tmp_path / "b")


def chunked_linear(chunks):
    """nn.Linear's forward summing its K dimension in ``chunks`` pieces, last first."""
    def forward(self, x):
        pieces = [F.linear(xs, ws) for xs, ws in zip(x.chunk(chunks, -1), self.weight.chunk(chunks, -1))]
        return sum(reversed(pieces)) + self.bias
    return forward


def linear(seed=0, k=256, n=32):
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n)


def hidden(seed=1, shape=(4, 256), dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_one_linear_under_two_summation_orders_is_rounding(tmp_path):
    b = linear()
    b.forward = types.MethodType(chunked_linear(8), b)
    result = bisected(tmp_path, linear(), b, hidden())
    d = result.first_divergence
    assert (d.module, d.event) == ("op", "output")
    cause = d.cause
    assert (cause.cause_class, cause.side, cause.op, cause.reference) == ("rounding", None, "linear", "float64")
    assert 0 < max(cause.ulp_a, cause.ulp_b) <= ROUNDING_ULPS
    assert "both within rounding" in cause.description and "batch-invariant" in cause.description


def test_a_bf16_variance_on_side_b_is_precision_on_b(tmp_path):
    cause = bisected(tmp_path, RMSNorm(256), RMSNorm(256, variance_dtype=torch.bfloat16), hidden()).first_divergence.cause
    assert (cause.cause_class, cause.side, cause.op) == ("precision", "b", "RMSNorm")
    assert cause.ulp_a <= ROUNDING_ULPS < cause.ulp_b
    assert "B loses precision" in cause.description


def test_an_fp16_matmul_on_side_a_is_precision_on_a(tmp_path):
    a = linear()
    a.forward = types.MethodType(lambda self, x: F.linear(x.half(), self.weight.half(), self.bias.half()).float(), a)
    cause = bisected(tmp_path, a, linear(), hidden()).first_divergence.cause
    assert (cause.cause_class, cause.side) == ("precision", "a")
    assert cause.ulp_b <= ROUNDING_ULPS < cause.ulp_a


PLANTS = {
    "bf16 variance": lambda: RMSNorm(64, variance_dtype=torch.bfloat16),
    "eps": lambda: RMSNorm(64, eps=0.1),
    "scaled output": lambda: Scaled(RMSNorm(64)),
}


class Scaled(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x) * 1.5


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), plant=st.sampled_from(sorted(PLANTS)))
def test_swapping_the_sides_swaps_the_side_named_and_the_figures_and_keeps_the_class(tmp_path_factory, seed, plant):
    tmp_path = tmp_path_factory.mktemp("swap")
    bisected(tmp_path, RMSNorm(64), PLANTS[plant](), hidden(seed, (3, 64)))
    forward = bisect_dumps(tmp_path / "a", tmp_path / "b").first_divergence.cause
    backward = bisect_dumps(tmp_path / "b", tmp_path / "a").first_divergence.cause
    other = {"a": "b", "b": "a", None: None}
    assert (backward.cause_class, backward.side) == (forward.cause_class, other[forward.side])
    assert (backward.ulp_a, backward.ulp_b, backward.equal_a, backward.equal_b) == (
        forward.ulp_b, forward.ulp_a, forward.equal_b, forward.equal_a)


def test_a_wrong_eps_is_logic_and_names_the_settings(tmp_path):
    cause = bisected(tmp_path, RMSNorm(256), RMSNorm(256, eps=0.1), hidden()).first_divergence.cause
    assert cause.cause_class == "logic"
    assert cause.differing == ["eps 1e-06 vs 0.1"]
    assert "eps 1e-06 vs 0.1" in cause.description
    assert cause.side is None  # each side computes its own eps exactly: nothing tells which is intended


def test_a_rope_offset_is_logic_on_the_side_that_departs(tmp_path):
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    config = Qwen2Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=64)
    a, b = Qwen2RotaryEmbedding(config), Qwen2RotaryEmbedding(config)
    plain = Qwen2RotaryEmbedding.forward
    b.forward = types.MethodType(lambda self, x, position_ids: plain(self, x, position_ids + 1), b)
    x, positions = hidden(shape=(1, 16, 64)), torch.arange(16)[None]
    cause = bisected(tmp_path, a, b, x, positions).first_divergence.cause
    assert (cause.cause_class, cause.side, cause.op) == ("logic", "b", "RoPE")
    assert cause.differing == []
    assert "B departs from the RoPE" in cause.description


def test_a_perturbed_input_is_inherited(tmp_path):
    x = hidden()
    perturbed = x.clone()
    perturbed[2, 7] += 1e-3
    for side, value in (("a", x), ("b", perturbed)):
        with torch.no_grad(), tdiff.capture(tmp_path / side, params=True):
            RMSNorm(256)(value)
    d = bisect_dumps(tmp_path / "a", tmp_path / "b").first_divergence
    assert (d.event, d.introduced) == ("input", False)
    assert (d.cause.cause_class, d.cause.side) == ("inherited", None)


def test_without_params_the_cause_is_unknown_and_says_what_is_missing(tmp_path):
    cause = bisected(tmp_path, RMSNorm(64), RMSNorm(64, eps=0.1), hidden(shape=(2, 64)),
                     params=False).first_divergence.cause
    assert (cause.cause_class, cause.side, cause.ulp_a, cause.ulp_b) == ("unknown", None, None, None)
    assert "--params" in cause.description


def test_an_op_with_no_canonical_form_is_unknown(tmp_path):
    class Scale(torch.nn.Module):
        def __init__(self, factor):
            super().__init__()
            self.factor = factor

        def forward(self, x):
            return x * self.factor

    cause = bisected(tmp_path, Scale(2.0), Scale(2.5), hidden()).first_divergence.cause
    assert cause.cause_class == "unknown"
    assert "no canonical op is known for a `Scale`" in cause.description


def test_the_cause_reads_back_from_json(tmp_path):
    result = bisected(tmp_path, RMSNorm(64), RMSNorm(64, variance_dtype=torch.bfloat16), hidden(shape=(2, 64)))
    data = result.to_json()
    assert set(data["first_divergence"]["cause"]) >= {"class", "side", "ulp_a", "ulp_b", "reference"}
    assert BisectResult.from_json(data) == result


def test_the_share_and_ulps_are_those_of_the_tensors(tmp_path):
    """The figures against an exact RMSNorm computed here, rounded by picking the nearest bf16."""
    x = hidden(shape=(8, 64), dtype=torch.bfloat16)
    a, b = RMSNorm(64).bfloat16(), RMSNorm(64, variance_dtype=torch.bfloat16).bfloat16()
    cause = bisected(tmp_path, a, b, x).first_divergence.cause
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * a.weight.double()
    nearest = nearest_bf16(exact)
    with torch.no_grad():
        for module, equal, ulp in ((a, cause.equal_a, cause.ulp_a), (b, cause.equal_b, cause.ulp_b)):
            out = module(x)
            assert equal == pytest.approx(float((out == nearest).double().mean()))
            spacing = math.ldexp(1.0, math.frexp(float(exact.abs().max()))[1] - 8)
            assert ulp == pytest.approx(float((out.double() - exact).abs().max()) / spacing)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-1e30, max_value=1e30, allow_nan=False, allow_subnormal=False), min_size=1,
                max_size=32))
def test_correct_rounding_picks_thenearest_bf16(values):
    exact = torch.tensor(values, dtype=torch.float64)
    assert torch.equal(correctly_rounded(exact, torch.bfloat16), nearest_bf16(exact))


def test_double_rounding_through_float32_is_avoided():
    # 1 + 2^-8 + 2^-30: float32 rounds it to 1 + 2^-8 (a bf16 tie), which then rounds to even (1.0);
    # the nearest bf16 is 1 + 2^-7
    exact = torch.tensor([1 + 2**-8 + 2**-30], dtype=torch.float64)
    assert exact.to(torch.bfloat16).item() == 1.0
    assert correctly_rounded(exact, torch.bfloat16).item() == 1 + 2**-7


def test_thresholds_order():
    assert ROUNDING_ULPS * 2.0**-23 < LOGIC_RELATIVE and CORRECTLY_ROUNDED < 1


class Layer(torch.nn.Module):
    """A pre-norm block: h = x + attn(norm(x)), then post_attention_layernorm(h); ``add`` does the
    residual add (side B's own, where planted)."""

    def __init__(self, add):
        super().__init__()
        torch.manual_seed(0)
        self.input_layernorm = RMSNorm(64)
        self.self_attn = torch.nn.Linear(64, 64)
        self.post_attention_layernorm = RMSNorm(64)
        self.add = add

    def forward(self, x):
        return self.post_attention_layernorm(self.add(x, self.self_attn(self.input_layernorm(x))))


class Model(torch.nn.Module):
    def __init__(self, add):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(add)])

    def forward(self, x):
        return self.layers[0](x)


@pytest.mark.parametrize("add, expected", [
    (lambda x, y: (x.bfloat16() + y.bfloat16()).float(), ("precision", "b")),
    (lambda x, y: x + 2 * y, ("logic", "b")),
])
def test_the_residual_add_of_a_decoder_layer_is_replayed(tmp_path, add, expected):
    for side, model in (("a", Model(torch.add)), ("b", Model(add))):
        with torch.no_grad(), tdiff.capture(tmp_path / side, params=True):
            model(hidden(shape=(3, 64)))
    d = bisect_dumps(tmp_path / "a", tmp_path / "b").first_divergence
    assert (d.module, d.event, d.kind) == ("layers.0", "between", "residual")
    assert (d.cause.cause_class, d.cause.side, d.cause.op) == (*expected, "residual add")
    assert d.cause.ulp_a <= 0.5 and d.cause.equal_a == 1.0   # one float32 add rounds correctly


def test_the_swap_runs_each_sides_framework_op_on_the_other_sides_inputs(tmp_path):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(0)
    a, b = torch.nn.RMSNorm(64, eps=1e-6).bfloat16(), Qwen2RMSNorm(64, eps=1e-6).bfloat16()
    with torch.no_grad():
        a.weight.copy_(torch.linspace(0.5, 1.5, 64))
        b.weight.copy_(a.weight)
    x = hidden(shape=(16, 64), dtype=torch.bfloat16) * 3
    with torch.no_grad():
        assert not torch.equal(a(x), b(x)), "premise: torch's and transformers' RMSNorm round differently"
    swap = bisected(tmp_path, a, b, x).first_divergence.swap
    assert (swap.b_on_a.module_class, swap.a_on_b.module_class) == (
        "transformers.models.qwen2.modeling_qwen2:Qwen2RMSNorm", "torch.nn.modules.normalization:RMSNorm")
    # on identical inputs each side's op gives its own output: the op differs, not the inputs
    assert (swap.b_on_a.equals_own, swap.b_on_a.equals_other, swap.b_on_a.problem) == (True, False, None)
    assert (swap.a_on_b.equals_own, swap.a_on_b.equals_other) == (True, False)
    assert "the op itself differs" in swap.b_on_a.describe()
    assert BisectResult.from_json(bisect_dumps(tmp_path / "a", tmp_path / "b").to_json()).first_divergence.swap == swap


def test_under_a_tolerance_the_swap_tells_inputs_from_the_kernel(tmp_path):
    """Inputs within the tolerance, amplified beyond it by a large weight: side B's own op on side
    A's inputs gives side A's output bitwise."""
    x = hidden(shape=(4, 64))
    nudged = x.clone()
    nudged[0, 0] = torch.nextafter(x[0, 0], torch.tensor(math.inf))
    layer = torch.nn.Linear(64, 8)
    with torch.no_grad():   # the nudged element times 1e6, nothing else: its ULP shows in the output
        layer.weight.zero_()
        layer.weight[:, 0] = 1e6
        layer.bias.zero_()
    for side, value in (("a", x), ("b", nudged)):
        with torch.no_grad(), tdiff.capture(tmp_path / side, params=True):
            Wrapper(layer)(value)
    from tdiff.compare.metrics import Tolerance

    d = bisect_dumps(tmp_path / "a", tmp_path / "b", tolerance=Tolerance(atol=1e-5, rtol=0.0)).first_divergence
    assert (d.module, d.event) == ("op", "output")
    assert (d.swap.b_on_a.equals_other, d.swap.a_on_b.equals_other) == (True, True)
    assert "the same kernel, the inputs make the difference" in d.swap.b_on_a.describe()


def test_a_class_outside_the_frameworks_is_not_imported_from_a_dump(tmp_path):
    d = bisected(tmp_path, RMSNorm(64), RMSNorm(64, eps=0.1), hidden(shape=(2, 64))).first_divergence
    assert "a swap imports only those" in d.swap.b_on_a.problem
    assert d.swap.b_on_a.equals_own is None


def test_sglangs_rmsnorm_against_transformers_names_hfs_double_rounding_and_swaps_both_ways(tmp_path):
    """Real SGLang RMSNorm (native forward on the CPU) against transformers' Qwen2RMSNorm, with
    the same non-unit weight: HF rounds the normalised values to bf16 before the weight's multiply
    (two roundings), SGLang once. Each framework's op, rebuilt from the dump, gives its own output
    on the other side's (identical) inputs: the ops differ, not the inputs."""
    from tests.stacks.sglang import install_import_shims

    install_import_shims()
    from sglang.srt.layers.layernorm import RMSNorm as SGLangRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    a, b = Qwen2RMSNorm(64, eps=1e-6).bfloat16(), SGLangRMSNorm(64, eps=1e-6).bfloat16()
    with torch.no_grad():
        a.weight.copy_(torch.linspace(0.5, 1.5, 64))
        b.weight.copy_(a.weight)
    x = hidden(shape=(16, 64), dtype=torch.bfloat16) * 3
    d = bisected(tmp_path, a, b, x).first_divergence
    exact = exact_rms_norm(x, a.weight.detach(), 1e-6)
    with torch.no_grad():
        share = {side: float((module(x) == nearest_bf16(exact)).double().mean()) for side, module in (("a", a), ("b", b))}
    assert (d.cause.equal_a, d.cause.equal_b) == (pytest.approx(share["a"]), pytest.approx(share["b"]))
    if share["b"] >= CORRECTLY_ROUNDED and share["a"] < 0.9:
        assert (d.cause.cause_class, d.cause.side) == ("precision", "a")
    assert d.swap.b_on_a.module_class == "sglang.srt.layers.layernorm:RMSNorm"
    for run in (d.swap.b_on_a, d.swap.a_on_b):
        assert (run.problem, run.equals_own, run.equals_other) == (None, True, False)



@pytest.mark.parametrize("module, why", [
    (lambda: Linear(), "does not map its input"),                    # refused before it runs
    (lambda: LayerNorm(), "does not run on the recorded tensors"),         # a weight F.layer_norm refuses
])
def test_recorded_tensors_the_op_cannot_take_make_the_cause_unknown_not_a_crash(tmp_path, module, why):
    a, b = module(), module()
    own = b.forward
    b.forward = lambda x: own(x) * 1.5
    d = bisected(tmp_path, a, b, hidden(shape=(4, 8))).first_divergence
    assert d.cause.cause_class == "unknown" and why in d.cause.description


class Linear(torch.nn.Module):
    """Named like a linear layer, its weight laid out otherwise."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2, 3))

    def forward(self, x):
        return x * self.weight.sum()


class LayerNorm(torch.nn.Module):
    """Named like a layer norm, its weight one scalar."""

    def __init__(self):
        super().__init__()
        self.eps = 1e-5
        self.weight = torch.nn.Parameter(torch.full((1,), 2.0))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * self.weight


class OffsetRMSNorm(RMSNorm):
    """Gemma's form: the weight is an offset from 1, not the canonical RMSNorm's weight."""

    def forward(self, x):
        return super().forward(x) / self.weight * (1 + self.weight)


def test_a_module_that_computes_another_op_than_the_canonical_one_on_both_sides_is_unknown(tmp_path):
    b = OffsetRMSNorm(64)
    own = b.forward
    b.forward = lambda x: own(x) * 1.001
    cause = bisected(tmp_path, OffsetRMSNorm(64), b, hidden(shape=(2, 64))).first_divergence.cause
    assert (cause.cause_class, cause.side) == ("unknown", None)
    assert "neither side's result is a RMSNorm of its recorded tensors" in cause.description
