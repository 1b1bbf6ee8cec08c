"""Capture on a CUDA GPU: pinned side-stream copies (full mode) and the fused device summary
(stats mode). Skipped on machines without CUDA; run on the GPU machine with
`python -m pytest tests/hooks/test_cuda_capture.py`."""

import pytest
import torch

import tdiff
from tdiff.compare import compare_dumps
from tdiff.store import open_dump
from tests.helpers import tiny_qwen2, token_ids

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
            y = producer(torch.ones(1 << 20, device="cuda"))
            y.mul_(2)  # queued on the compute stream right after the hook's copy was issued
        torch.cuda.synchronize()
    dump = open_dump(tmp_path / "d")
    for record in dump.records:
        assert torch.equal(dump.load(record), torch.ones(1 << 20)), record.name
