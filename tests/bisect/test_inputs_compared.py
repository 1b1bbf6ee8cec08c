"""bisect says "its inputs match" only when every input of the named module or op was compared
and equal (issue 27 §8): a parameter or buffer the culprit reads, an operand made on a helper
thread, an input one side alone passes are named as not compared, with why."""

import types
from concurrent.futures import ThreadPoolExecutor

import torch

import tdiff
from tdiff.bisect import bisect_dumps
from tests.helpers import tiny_qwen2, token_ids

NOT_RECORDED = "weight (parameters and buffers are not recorded)"


def capture(path, forward, ops=(), model=None, params=False):
    with torch.no_grad(), tdiff.capture(path, ops=list(ops), model=model, params=params):
        forward()
    return path


def stale_weight_pair(tmp_path, ops=(), params=False):
    """A tiny Qwen2; side B's layer-0 down projection holds a stale weight (one element off)."""
    model = tiny_qwen2()
    a = capture(tmp_path / "a", lambda: model(token_ids()), ops, params=params)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3
    return bisect_dumps(a, capture(tmp_path / "b", lambda: model(token_ids()), ops, params=params))


def test_a_stale_weight_both_runs_stored_is_named_as_differing(tmp_path):
    divergence = stale_weight_pair(tmp_path, params=True).first_divergence
    assert divergence.module == "model.layers.0.mlp.down_proj"
    assert divergence.description == ("`model.layers.0.mlp.down_proj`: its parameters differ between the runs: "
                                      "weight (their fingerprints, stored by --params); its other inputs match; "
                                      "its output differs")


def test_parameters_both_runs_stored_and_equal_count_as_compared(tmp_path):
    model = tiny_qwen2()
    a = capture(tmp_path / "a", lambda: model(token_ids()), params=True)
    norm = model.model.layers[0].post_attention_layernorm
    norm.register_forward_hook(lambda module, args, output: output + 1e-2)   # the op, not its weight
    divergence = bisect_dumps(a, capture(tmp_path / "b", lambda: model(token_ids()), params=True)).first_divergence
    assert divergence.module == "model.layers.0.post_attention_layernorm"
    assert divergence.not_compared is None
    assert divergence.description.endswith(": its inputs match, its output differs")


def test_a_stale_weight_is_not_blamed_on_a_module_whose_inputs_match(tmp_path):
    divergence = stale_weight_pair(tmp_path).first_divergence
    assert divergence.module == "model.layers.0.mlp.down_proj" and divergence.event == "output"
    assert divergence.not_compared == NOT_RECORDED
    assert divergence.description == ("`model.layers.0.mlp.down_proj`: its compared inputs match; not compared: "
                                      f"{NOT_RECORDED}; its output differs")
    assert "its inputs match" not in divergence.description


def test_a_stale_weight_is_not_blamed_on_aten_t_with_inputs_matching(tmp_path):
    result = stale_weight_pair(tmp_path, ops=[r"^model\.layers\.0\.mlp\.down_proj$"])
    op = result.first_divergence.op
    assert op is not None and not op.parted, result.to_json()
    assert op.not_compared == NOT_RECORDED
    assert op.describe().endswith(f": its compared inputs match; not compared: {NOT_RECORDED}; its output differs")
    assert result.to_json()["first_divergence"]["op"]["not_compared"] == NOT_RECORDED


class HelperThreadScale(torch.nn.Module):
    """Multiplies by a factor computed on a helper thread (outside the traced ops)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor
        self.pool = ThreadPoolExecutor(1)

    def forward(self, x):
        scale = self.pool.submit(lambda: torch.full((x.shape[-1],), 1.0) * self.factor).result()
        return x * scale


def test_an_operand_made_on_a_helper_thread_is_named_as_not_compared(tmp_path):
    x = torch.arange(6.0).reshape(2, 3)
    dumps = []
    for side, factor in (("a", 2.0), ("b", 2.0 + 1e-6)):
        module = HelperThreadScale(factor)
        dumps.append(capture(tmp_path / side, lambda module=module: module(x), ops=[r"^$"], model=module))
    result = bisect_dumps(*dumps)
    divergence = result.first_divergence
    assert divergence.op is not None and divergence.op.name == "aten::mul.Tensor", result.to_json()
    assert divergence.op.not_compared.startswith("input 1 (made where no op record holds it")
    assert "its compared inputs match" in divergence.op.describe()



class CachedPrefixBackend:
    """An SGLang attention backend: the new tokens attend over the keys and values cached before
    them (in the forward batch's KV pool) and their own."""

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        pool = forward_batch.token_to_kv_pool
        keys, values = torch.cat([pool.k, k]).transpose(0, 1), torch.cat([pool.v, v]).transpose(0, 1)
        q = q.view(q.shape[0], layer.tp_q_head_num, layer.qk_head_dim).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, scale=layer.scaling)
        return out.transpose(0, 1).reshape(q.shape[1], -1)


def capture_radix_attention(path, stale_cache: bool):
    """SGLang's RadixAttention over a real ForwardBatch whose KV pool holds 5 cached tokens."""
    from tests.stacks.sglang import install_import_shims

    install_import_shims()
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    generator = torch.Generator().manual_seed(0)
    heads, dim, tokens, cached = 2, 4, 3, 5
    attention = RadixAttention(heads, dim, dim ** -0.5, heads, layer_id=0)
    q, k, v = (torch.randn(tokens, heads * dim, generator=generator) for _ in range(3))
    pool = types.SimpleNamespace(k=torch.randn(cached, heads, dim, generator=generator),
                                 v=torch.randn(cached, heads, dim, generator=generator))
    if stale_cache:
        pool.v[0, 0, 0] += 1e-3
    batch = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.arange(tokens),
                         req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([cached + tokens]),
                         out_cache_loc=torch.arange(cached, cached + tokens), seq_lens_sum=cached + tokens)
    batch.token_to_kv_pool = pool
    with forward_context(ForwardContext(attn_backend=CachedPrefixBackend()), forward_batch=batch):
        return capture(path, lambda: attention(q, k, v, batch), model=attention)


def test_an_attention_reading_a_kv_cache_through_its_forward_batch_is_not_said_to_have_matching_inputs(tmp_path):
    divergence = bisect_dumps(capture_radix_attention(tmp_path / "a", stale_cache=False),
                              capture_radix_attention(tmp_path / "b", stale_cache=True)).first_divergence
    assert divergence.event == "output" and divergence.kind == "attention"
    assert divergence.not_compared == "forward_batch (an object tdiff does not record: ForwardBatch)"
    assert divergence.description.endswith(": its compared inputs match; not compared: forward_batch (an object tdiff "
                                           "does not record: ForwardBatch); its output differs")
