"""Capture on a CUDA GPU: snapshots copied out through bounded staging memory (full mode) and
the fused device summary (stats mode). Skipped on machines without
CUDA; run on the GPU machine with `python -m pytest tests/hooks/test_cuda_capture.py` (the
megatron-core test also needs megatron-core installed)."""

import pytest
import torch

import tdiff
from tdiff.compare import compare_dumps
from tdiff.store import open_dump
from tests.helpers import tiny_qwen2, token_ids
from tests.stacks import free_port

BIG = 1 << 24  # elements: a host copy this large still runs when the next kernels start

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run(model, ids, path, **options):
    with torch.no_grad(), tdiff.capture(path, **options):
        model(ids)
    return open_dump(path)


def test_full_mode_stores_exactly_what_the_model_computed(tmp_path):
    model, ids = tiny_qwen2(torch.bfloat16).cuda(), token_ids(64).cuda()
    expected = {}
    handles = [m.register_forward_hook(lambda m, i, o, n=n: expected.__setitem__(n, o.detach().cpu().clone()))
               for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    dump = run(model, ids, tmp_path / "a")
    for h in handles:
        h.remove()
    outputs = {r.module: r for r in dump.records if r.role == "output" and r.module in expected}
    assert outputs.keys() == expected.keys()
    for name, record in outputs.items():
        assert record.device.startswith("cuda")
        assert torch.equal(dump.load(record).view(torch.int16), expected[name].view(torch.int16)), name


def test_stats_mode_fingerprints_agree_with_full_mode_data(tmp_path):
    model, ids = tiny_qwen2(torch.bfloat16).cuda(), token_ids(64).cuda()
    stats = run(model, ids, tmp_path / "stats", mode="stats")
    assert all(r.fingerprint.startswith("wsum64:") and r.file is None for r in stats.records)
    assert all(r.stats["nan"] == 0 for r in stats.records)
    full = run(model, ids, tmp_path / "full")
    # the comparison recomputes wsum64 from the stored data: equal bits must give equal digests
    assert compare_dumps(stats, full).status == "match"
    assert compare_dumps(stats, run(model, ids, tmp_path / "stats2", mode="stats")).status == "match"


def test_stats_mode_catches_one_ulp_on_the_gpu(tmp_path):
    model, ids = tiny_qwen2(torch.bfloat16).cuda(), token_ids(64).cuda()
    a = run(model, ids, tmp_path / "a", mode="stats")

    def plant(module, args, output):
        output = output.clone()
        output.view(torch.int16).view(-1)[3] += 1
        return output

    handle = model.get_submodule("model.layers.1.mlp.down_proj").register_forward_hook(plant)
    b = run(model, ids, tmp_path / "b", mode="stats")
    handle.remove()
    assert compare_dumps(a, b).first_divergence.name == "model.layers.1.mlp.down_proj"


def test_an_in_place_change_after_the_hook_does_not_reach_the_copy(tmp_path):
    class Producer(torch.nn.Module):
        def forward(self, x):
            return x * 1

    producer = Producer()
    with tdiff.capture(tmp_path / "d"):
        for _ in range(3):
            y = producer(torch.ones(BIG, device="cuda"))
            y.mul_(2)  # queued on the compute stream right after the hook returned
        torch.cuda.synchronize()
    dump = open_dump(tmp_path / "d")
    assert len(dump.records) == 6
    for record in dump.records:
        assert torch.equal(dump.load(record), torch.ones(BIG)), record.name


def test_a_linear_output_added_to_in_place_is_recorded_as_the_linear_returned_it(tmp_path):
    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4096, 4096, device="cuda")

        def forward(self, x):
            out = self.linear(x)
            return out.add_(x)

    torch.manual_seed(0)
    block, x = Residual(), torch.randn(BIG // 4096, 4096, device="cuda")
    with torch.no_grad():
        expected = block.linear(x).cpu()
        with tdiff.capture(tmp_path / "d"):
            block(x)
    dump = open_dump(tmp_path / "d")
    linear = next(r for r in dump.records if r.module == "linear" and r.role == "output")
    assert torch.equal(dump.load(linear), expected)


def megatron_on_this_gpu():
    import torch.distributed as dist

    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_megatron_bias_dropout_add_does_not_reach_the_recorded_outputs(tmp_path, grad_mode):
    """In eval mode, without gradients, megatron-core adds the residual into linear_proj's and
    linear_fc2's outputs in place (bias-dropout-add) right after they return."""
    megatron_on_this_gpu()
    from tests.stacks.megatron import build_gpt, gpt_config, gpt_forward

    config = gpt_config(layers=1, hidden=4096, heads=32, query_groups=8, ffn=1024)
    model = build_gpt(config, vocab=128, max_sequence=1024).cuda()
    ids = torch.randint(0, 128, (BIG // 4096 // 1024, 1024), device="cuda")
    returned = {}

    def keep(name):
        def hook(module, args, output):
            returned[name] = output[0].detach().clone()  # on the compute stream: the bytes as returned
        return hook

    names = ("decoder.layers.0.self_attention.linear_proj", "decoder.layers.0.mlp.linear_fc2")
    handles = [model.get_submodule(name).register_forward_hook(keep(name)) for name in names]
    with grad_mode(), tdiff.capture(tmp_path / "d"):
        gpt_forward(model, ids)
    for handle in handles:
        handle.remove()
    dump = open_dump(tmp_path / "d")
    for name in names:
        record = next(r for r in dump.records if r.module == name and r.role == "output" and r.sub == "0")
        assert returned[name].numel() == BIG
        assert torch.equal(dump.load(record), returned[name].cpu()), name


def test_staging_stays_within_its_bound_and_loses_nothing(tmp_path, monkeypatch):
    """A small staging bound, tensors below it, at it and above it (copied to the host on the
    compute stream), each changed in place after its hook: every record holds its own bytes."""
    from tdiff.hooks import device

    bound = 4 << 20
    monkeypatch.setenv("TDIFF_MAX_DEVICE_STAGING", "4MiB")

    class Producer(torch.nn.Module):
        def forward(self, x):
            return x * 1

    producer, held = Producer(), []
    sizes = [1 << 18, 1 << 20, 1 << 22, 1 << 16] * 8  # float32: 1 MiB, 4 MiB, 16 MiB, 256 KiB
    with tdiff.capture(tmp_path / "d"):
        for value, size in enumerate(sizes):
            y = producer(torch.full((size,), float(value), device="cuda"))
            y.mul_(-1)
            held.append(sum(s.held for s in device._staging.values()))
    assert max(held) <= bound
    dump = open_dump(tmp_path / "d")
    outputs = [r for r in dump.records if r.role == "output"]
    assert len(outputs) == len(sizes)
    for record, (value, size) in zip(sorted(outputs, key=lambda r: r.seq), enumerate(sizes)):
        assert torch.equal(dump.load(record), torch.full((size,), float(value))), record.seq
