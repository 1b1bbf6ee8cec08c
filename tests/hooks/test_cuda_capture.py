"""Capture on a CUDA GPU: snapshots copied out through bounded staging memory (full mode) and
the fused device summary with its mix64 fingerprint (stats mode). Skipped on machines without
CUDA; run on the GPU machine with `python -m pytest tests/hooks/test_cuda_capture.py` (the
megatron-core test also needs megatron-core installed)."""

import json

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
    assert all(r.fingerprint.startswith("mix64:") and r.file is None for r in stats.records)
    assert all(r.stats["nan"] == 0 for r in stats.records)
    full = run(model, ids, tmp_path / "full")
    # the comparison recomputes mix64 from the stored data on the host: equal bits must give
    # equal digests, from the Triton kernel and from torch on the CPU alike
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


def plant_in_stats_mode(model, ids, path, module, plant):
    def hook(module, args, output):
        output = output.clone()
        plant(output)
        return output

    handle = model.get_submodule(module).register_forward_hook(hook)
    try:
        return run(model, ids, path, mode="stats")
    finally:
        handle.remove()


def test_stats_mode_catches_two_sign_flips_that_cancel_in_wsum64(tmp_path):
    """bf16 elements 3 and 7 hold the sign bits 63 of two words: wsum64 added 2**63 twice."""
    model, ids = tiny_qwen2(torch.bfloat16).cuda(), token_ids(64).cuda()
    a = run(model, ids, tmp_path / "a", mode="stats")

    def flip_signs(output):
        output.view(torch.int16).view(-1)[[3, 7]] ^= -(1 << 15)

    b = plant_in_stats_mode(model, ids, tmp_path / "b", "model.layers.0.mlp.down_proj", flip_signs)
    assert compare_dumps(a, b).first_divergence.name == "model.layers.0.mlp.down_proj"


def test_stats_mode_catches_two_negative_zeros(tmp_path):
    class Zeros(torch.nn.Module):
        def forward(self, x):
            return torch.zeros(64, device=x.device)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.zeros = Zeros()

        def forward(self, x):
            return self.zeros(x) + 1

    model, x = Model(), torch.ones(1, device="cuda")
    a = run(model, x, tmp_path / "a", mode="stats")

    def negative_zeros(output):
        output[[1, 3]] = -0.0  # fp32 elements 1 and 3: the sign bits 63 of words 0 and 1

    b = plant_in_stats_mode(model, x, tmp_path / "b", "zeros", negative_zeros)
    assert compare_dumps(a, b).first_divergence.name == "zeros"


def test_the_fused_kernel_the_torch_ops_and_the_cpu_give_one_mix64_digest():
    """Sign flips, +-0, NaN payloads and a single-bit flip at each of the 64 bit positions, at
    words inside and on the edges of the kernel's blocks: variants with different bytes have
    different digests, and the fused kernel, torch on the GPU and torch on the CPU agree on each."""
    from tdiff.store.device_summary import fused_summary
    from tdiff.store.fingerprint import mix64_fingerprint_tensor

    def digests(t):
        fused = int(fused_summary(t)[6:].view(torch.int64)[0])
        return fused, int(mix64_fingerprint_tensor(t)), int(mix64_fingerprint_tensor(t.cpu()))

    generator = torch.Generator("cuda").manual_seed(0)
    seen = {}
    for dtype, n in ((torch.float32, 8), (torch.bfloat16, 4096 * 3 + 4), (torch.float16, 1 << 12),
                     (torch.float32, (1 << 23) + 2)):  # the last: more words than one torch round
        base = torch.randn(n, device="cuda", generator=generator).to(dtype)
        base[0] = 0.0
        base[1] = float("nan")
        words = base.view(torch.int64)
        variants = {"original": base}
        edges = {0, 1, 1023, 1024, 2047, 2048, words.numel() // 2, words.numel() - 1}  # blocks: 1024 or 2048 words
        for word in sorted(edges & set(range(words.numel()))):
            for bit in range(64):
                changed = words.clone()
                changed[word] ^= -(1 << 63) if bit == 63 else 1 << bit
                variants[f"word {word} bit {bit}"] = changed.view(dtype)
        bits = base.view(torch.int16 if dtype.itemsize == 2 else torch.int32)
        sign = -(1 << (8 * dtype.itemsize - 1))
        for name, index in (("signs 3 and 7", [3, 7]), ("+0 to -0", [0]), ("signs 1 and 3", [1, 3])):
            changed = bits.clone()
            changed[index] ^= sign
            variants[name] = changed.view(dtype)
        payload = bits.clone()
        payload[1] ^= 1  # another NaN
        variants["NaN payload"] = payload.view(dtype)
        for name, t in variants.items():
            if name.startswith("word") and n > 1 << 20 and not name.endswith((" bit 0", " bit 63")):
                fused = int(fused_summary(t)[6:].view(torch.int64)[0])  # the CPU check only at the ends
                triple = (fused, int(mix64_fingerprint_tensor(t)), fused)
            else:
                triple = digests(t)
            assert triple[0] == triple[1] == triple[2], (dtype, n, name, triple)
            if triple[0] in seen:  # only a variant with the very same bytes may share a digest
                other_name, other = seen[triple[0]]
                assert torch.equal(other.view(torch.uint8), t.view(torch.uint8)), (dtype, n, name, other_name)
            seen[triple[0]] = (name, t)


def test_one_group_launch_gives_each_tensor_the_summary_the_torch_ops_give():
    """Up to eight tensors of one dtype in one launch (sizes on and off the block edges, NaN, inf,
    slices that start inside their storage): each table row holds the tensor's own statistics and
    mix64 digest, as the torch ops compute them."""
    from tdiff.store.device_summary import GROUP, group_summary_into
    from tdiff.store.fingerprint import mix64_fingerprint_tensor, tensor_stats

    generator = torch.Generator("cuda").manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32):
        def draw(n, dtype=dtype):
            if dtype.is_floating_point:
                return (torch.randn(n, device="cuda", generator=generator) * 3).to(dtype)
            return torch.randint(-50_000, 50_000, (n,), device="cuda", generator=generator).to(dtype)

        storage = draw(1 << 16)
        if dtype.is_floating_point:
            storage[77], storage[78] = float("nan"), float("inf")
        tensors = [draw(n) for n in (8, 4096, 4100, 3 * 4096 + 16, 12_000, 40_000)]
        tensors += [storage[64:64 + 9000], storage[:8]]
        assert len(tensors) == GROUP
        for count in (1, 3, GROUP):
            table = torch.full((16, 7), float("nan"), dtype=torch.float64, device="cuda")
            counters = torch.zeros(16, 1, dtype=torch.int32, device="cuda")
            group_summary_into(tensors[:count], table, counters, 5)
            for i, t in enumerate(tensors[:count]):
                assert int(table[5 + i].view(torch.int64)[6]) == int(mix64_fingerprint_tensor(t)), (dtype, i)
                assert torch.allclose(table[5 + i, :6], tensor_stats(t), rtol=1e-5, equal_nan=True), \
                    (dtype, i, table[5 + i], tensor_stats(t))
            assert not counters.any()  # every counter left at zero for the next launch
            assert table[:5].isnan().all() and table[5 + count:].isnan().all()  # no other row written


def test_stats_of_tensors_changed_in_place_right_after_the_hook_are_their_values_then(tmp_path):
    """Grouped summaries are launched before the module runs (inputs) and before its caller goes
    on (outputs): a stats dump of tensors changed in place right after equals a full dump."""
    class Pair(torch.nn.Module):
        def forward(self, x, y):
            return x * 1, y * 1, x + y

    module = Pair()
    x = torch.randn(3000, device="cuda")
    y = torch.randn(3000, device="cuda")
    for mode in ("stats", "full"):
        with tdiff.capture(tmp_path / mode, mode=mode):
            a, b, c = module(x.clone(), y.clone())
            a.mul_(2), b.add_(1), c.neg_()
            torch.cuda.synchronize()
    stats, full = open_dump(tmp_path / "stats"), open_dump(tmp_path / "full")
    assert len(stats.records) == len(full.records) == 5
    assert compare_dumps(full, stats).first_divergence is None
    for s, f in zip(stats.records, full.records):
        assert s.stats == pytest.approx(f.stats, rel=1e-5), s.name


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
        """A small input, a 16M-element output: its host copy is still running when add_ starts."""

        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(64, 4096, device="cuda")
            self.register_buffer("residual", torch.randn(BIG // 4096, 4096, device="cuda"))

        def forward(self, x):
            out = self.linear(x)
            return out.add_(self.residual)

    torch.manual_seed(0)
    block, x = Residual(), torch.randn(BIG // 4096, 64, device="cuda")
    with torch.no_grad():
        expected = block.linear(x).cpu()
        with tdiff.capture(tmp_path / "d"):
            for _ in range(3):
                block(x)
    dump = open_dump(tmp_path / "d")
    outputs = [r for r in dump.records if r.module == "linear" and r.role == "output"]
    assert len(outputs) == 3
    for record in outputs:
        assert torch.equal(dump.load(record), expected), record.step


@pytest.fixture
def megatron_on_this_gpu():
    """A one-rank NCCL group and megatron's parallel state, torn down after the test: a process
    group left behind would give later tests of this process its rank."""
    import torch.distributed as dist

    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_megatron_bias_dropout_add_does_not_reach_the_recorded_outputs(tmp_path, grad_mode, megatron_on_this_gpu):
    """In eval mode, without gradients, megatron-core adds the residual into linear_proj's and
    linear_fc2's outputs in place (bias-dropout-add) right after they return."""
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


def test_a_capture_that_records_nothing_does_not_synchronise_the_forward(tmp_path):
    """Issue 30: the token metadata of each forward was copied to the host with a synchronising
    copy, which stopped the host at every forward (and an engine's run-ahead); it is copied without
    a wait and described by the writer."""
    model = tiny_qwen2().cuda()
    ids = token_ids(12).reshape(2, 6).cuda()
    with torch.no_grad(), tdiff.capture(tmp_path / "a", select=["nothing-matches-this"]):
        model(ids)   # the first forward names the modules and starts the writer
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    lines = [json.loads(line) for path in (tmp_path / "a" / "manifests").iterdir()
             for line in path.read_text().splitlines()]
    assert [line["input_ids"] for line in lines if line["type"] == "tokens"] == [ids.flatten().tolist()] * 2
