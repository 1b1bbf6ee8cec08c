"""The mix64 fingerprint (torch ops, any device): a pure-Python reference, the changes wsum64
misses, single-bit flips at every bit position, and dumps that carry either algorithm.

The same digests from the fused Triton kernel: tests/store/test_device_summary.py (interpreter)
and tests/hooks/test_cuda_capture.py (on a GPU)."""

import json
import math
import os
import struct

import pytest
import torch

import tdiff
from tdiff.compare import compare_dumps
from tdiff.store import fingerprint, open_dump
from tdiff.store.fingerprint import fingerprint_as, mix64_fingerprint, mix64_fingerprint_tensor, \
    wsum64_fingerprint
from tests.helpers import tiny_qwen2, token_ids

MASK = (1 << 64) - 1


def splitmix64_finalize(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference_mix64(tensor: torch.Tensor) -> int:
    """The digest from its definition, with Python integers (unsigned, modulo 2**64)."""
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    raw += bytes(-len(raw) % 8)
    total = 0
    for index, (word,) in enumerate(struct.iter_unpack("<Q", raw)):
        key = splitmix64_finalize(((index + 1) * 0x9E3779B97F4A7C15) & MASK)
        total += splitmix64_finalize(word ^ key)
    return total & MASK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64])
@pytest.mark.parametrize("n", [1, 3, 8, 37])
def test_mix64_is_the_documented_function(dtype, n):
    t = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 50).to(dtype)
    assert int(mix64_fingerprint_tensor(t)) & MASK == reference_mix64(t)


def test_chunked_rounds_give_the_digest_of_one_round(monkeypatch):
    t = torch.randn(1001)
    whole = int(mix64_fingerprint_tensor(t))
    monkeypatch.setattr(fingerprint, "_MIX_CHUNK", 7)
    assert int(mix64_fingerprint_tensor(t)) == whole


def test_a_slice_off_a_word_boundary_is_fingerprinted_as_its_own_bytes():
    base = torch.randn(40).to(torch.bfloat16)
    piece = base[1:33]  # starts 2 bytes into the storage: its words cannot be a view
    assert mix64_fingerprint(piece) == mix64_fingerprint(piece.clone())


def test_changes_that_cancel_in_wsum64_change_mix64():
    bf16 = torch.randn(16).to(torch.bfloat16)
    flipped = bf16.clone()
    flipped[3], flipped[7] = -flipped[3], -flipped[7]  # sign bits 63 of words 0 and 1: 2**63 twice
    zeros = torch.zeros(8)
    negative = zeros.clone()
    negative[1], negative[3] = -0.0, -0.0              # fp32 sign bits at bit 63 of two words
    for a, b in ((bf16, flipped), (zeros, negative)):
        assert wsum64_fingerprint(a) == wsum64_fingerprint(b), "the weakness this algorithm replaces"
        assert mix64_fingerprint(a) != mix64_fingerprint(b)


def test_every_single_bit_flip_and_every_pair_of_sign_flips_changes_mix64():
    t = torch.tensor([1.0, -0.0, 0.0, math.inf, -math.inf, math.nan, 3.5e-42, -2.0] * 2)
    words = t.view(torch.int64)
    digests = {int(mix64_fingerprint_tensor(t))}
    variants = 0
    for index in range(words.numel()):
        for bit in range(64):
            changed = words.clone()
            changed[index] ^= -(1 << 63) if bit == 63 else 1 << bit
            digests.add(int(mix64_fingerprint_tensor(changed.view(torch.float32))))
            variants += 1
    for i in range(t.numel()):
        for j in range(i + 1, t.numel()):
            changed = t.clone()
            changed.view(torch.int32)[[i, j]] ^= -(1 << 31)
            digests.add(int(mix64_fingerprint_tensor(changed)))
            variants += 1
    assert len(digests) == variants + 1, "no two variants (nor the original) share a digest"


def test_nan_payloads_and_swapped_elements_change_mix64():
    t = torch.tensor([math.nan, 1.0, 2.0, 3.0])
    quiet_nan = t.clone()
    quiet_nan.view(torch.int32)[0] |= 1  # another NaN: same value for every statistic, other bits
    swapped = t[[0, 2, 1, 3]]
    assert len({mix64_fingerprint(t), mix64_fingerprint(quiet_nan), mix64_fingerprint(swapped)}) == 3


def test_the_fingerprint_covers_dtype_and_shape():
    t = torch.zeros(8)
    assert len({mix64_fingerprint(t), mix64_fingerprint(t.view(2, 4)), mix64_fingerprint(t.view(torch.int32))}) == 3


@pytest.mark.parametrize("algorithm", ["mix64", "wsum64"])
def test_stats_dumps_with_device_digests_compare_against_full_dumps(tmp_path, algorithm):
    """A stats-mode dump whose records carry mix64 (or, written by an older tdiff, wsum64)
    compares against a full-mode dump by recomputing that digest from the stored tensors."""
    model, ids = tiny_qwen2(torch.bfloat16), token_ids(16)
    with torch.no_grad():
        with tdiff.capture(tmp_path / "full"):
            model(ids)
        with tdiff.capture(tmp_path / "stats", mode="stats"):
            model(ids)
    full = open_dump(tmp_path / "full")
    tensors = {(r.name, r.role, r.call): full.load(r) for r in full.records}
    manifest = next((tmp_path / "stats" / "manifests").glob("*.jsonl"))
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    for line in lines:
        if line["type"] == "record":
            line["fingerprint"] = fingerprint_as(tensors[(line["name"], line["role"], line["call"])], algorithm)
    last = next(line for line in reversed(lines) if line["type"] == "record")
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = compare_dumps(open_dump(tmp_path / "stats"), full)
    assert result.status == "match", result.first_divergence

    wrong = tensors[(last["name"], last["role"], last["call"])].clone()
    wrong.view(-1)[0] = -wrong.view(-1)[0] if wrong.view(-1)[0] != 0 else 1
    last["fingerprint"] = fingerprint_as(wrong, algorithm)
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = compare_dumps(open_dump(tmp_path / "stats"), full)
    assert result.status != "match" and result.first_divergence.name == last["name"]


@pytest.mark.parametrize("threads", [1, 2])
def test_host_statistics_leave_the_callers_thread_count_and_give_the_tensors_values(threads):
    """host_stats leaves the caller's torch thread count as it was; the values are those of the tensor (means over finite values; NaN and inf counted apart)."""
    before = torch.get_num_threads()
    values = torch.randn(3, 70_000, generator=torch.Generator().manual_seed(threads))
    spoiled = values.clone()
    spoiled[0, :5], spoiled[1, :3], spoiled[2, 0] = math.nan, math.inf, -math.inf
    try:
        torch.set_num_threads(threads)
        for t in (values, spoiled):
            low, high, mean, abs_mean, nans, infs = fingerprint.host_stats(t)
            assert torch.get_num_threads() == threads
            finite = t[torch.isfinite(t)].double()
            not_nan = t[~torch.isnan(t)]
            assert (low, high) == (float(not_nan.min()), float(not_nan.max()))
            assert mean == pytest.approx(float(finite.sum()) / finite.numel(), abs=1e-6)
            assert abs_mean == pytest.approx(float(finite.abs().mean()), rel=1e-5)
            assert (nans, infs) == (int(torch.isnan(t).sum()), int(torch.isinf(t).sum()))
    finally:
        torch.set_num_threads(before)


def test_host_statistics_on_one_thread_leave_the_thread_count_other_threads_get_as_it_was():
    """torch's thread count is not only per calling thread: torch.set_num_threads also sets the
    count every thread starts with (at::set_num_threads' process-wide value, read by a thread's
    first parallel op). Statistics computed on the writer's thread must not change the model's."""
    import queue
    import threading

    before = torch.get_num_threads()
    jobs: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue()

    def writer_thread():
        while (job := jobs.get()) is not None:
            results.put(job())

    def count_of_a_new_thread() -> int:
        counts: list[int] = []
        thread = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        return counts[0]

    writer = threading.Thread(target=writer_thread)
    writer.start()
    try:
        torch.set_num_threads(2)
        jobs.put(torch.get_num_threads)   # the writer's thread starts with 2
        assert results.get() == 2
        torch.set_num_threads(3)          # the program changes its mind later
        assert count_of_a_new_thread() == 3
        jobs.put(lambda: fingerprint.host_stats(torch.randn(70_000)))
        results.get()
        assert count_of_a_new_thread() == 3 and torch.get_num_threads() == 3
    finally:
        jobs.put(None)
        writer.join()
        torch.set_num_threads(before)


def _chunked_cases():
    """Tensors over several of host_stats' chunks (NaN or inf in a late chunk only), and the kinds
    host_summary hands to host_stats and xxh3_fingerprint (copies, conversions, one element)."""
    chunk = fingerprint._CHUNK
    g = torch.Generator().manual_seed(7)
    big = torch.randn(2 * chunk + 12_345, generator=g)
    late_nan, late_inf = big.clone(), big.clone()
    late_nan[-3] = math.nan
    late_inf[chunk + 5] = -math.inf
    return {
        "float32, 3 chunks": big,
        "bfloat16, 3 chunks": big.bfloat16(),
        "float16, 2-d": big[: 2 * chunk].half().reshape(1024, -1),
        "float64": big[:70_000].double(),
        "NaN in the last chunk": late_nan,
        "-inf in the second chunk": late_inf,
        "strided": big[::3],
        "int64": torch.arange(-5, 70_000),
        "bool": torch.rand(1000, generator=g) > 0.5,
        "one element": torch.tensor([2.5]),
        "zero-dimensional": torch.tensor(-1.0),
        "empty": torch.empty(0, 4),
        "complex": torch.randn(300, dtype=torch.complex64, generator=g),
    }


@pytest.mark.parametrize("case", list(_chunked_cases()))
def test_host_summary_is_host_stats_and_the_xxh3_fingerprint_in_one_pass(case):
    t = _chunked_cases()[case]
    stats, digest = fingerprint.host_summary(t)
    assert digest == fingerprint.xxh3_fingerprint(t)
    expected = fingerprint.host_stats(t)
    assert stats == pytest.approx(expected, nan_ok=True)
    assert stats[4:] == expected[4:]


@pytest.mark.parametrize("case", list(_chunked_cases()))
def test_host_summary_hands_its_sink_the_bytes_in_order(case):
    # full mode's capture of a CPU tensor: what the sink gets is what its shard stores
    from tdiff.store.dtypes import to_bytes_view

    t = _chunked_cases()[case]
    pieces = []
    stats, digest = fingerprint.host_summary(t, sink=lambda data: pieces.append(bytes(data)))
    assert b"".join(pieces) == bytes(to_bytes_view(t).numpy().data)
    if t.is_contiguous() and t.numel() > fingerprint._CHUNK:
        assert len(pieces) == -(-t.numel() // fingerprint._CHUNK)  # a chunk at a time, from the cache
    expected = fingerprint.host_summary(t)[0]
    assert stats == pytest.approx(expected, nan_ok=True) and stats[4:] == expected[4:]
    assert digest == fingerprint.xxh3_fingerprint(t)


@pytest.mark.parametrize("case", ["float32, 3 chunks", "NaN in the last chunk", "-inf in the second chunk"])
def test_host_stats_over_several_chunks_are_the_tensors(case):
    t = _chunked_cases()[case]
    low, high, mean, abs_mean, nans, infs = fingerprint.host_stats(t)
    finite = t[torch.isfinite(t)].double()
    not_nan = t[~torch.isnan(t)]
    assert (low, high) == (float(not_nan.min()), float(not_nan.max()))  # exact: each is an element
    assert mean == pytest.approx(float(finite.mean()), abs=1e-6)
    assert abs_mean == pytest.approx(float(finite.abs().mean()), rel=1e-6)
    assert (nans, infs) == (int(torch.isnan(t).sum()), int(torch.isinf(t).sum()))


def _other_threads_cpu_seconds() -> float:
    """CPU time of this process's threads other than the calling one (Linux /proc)."""
    import threading

    me = threading.get_native_id()
    total = 0
    for task in os.listdir("/proc/self/task"):
        if int(task) != me:
            with open(f"/proc/self/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="needs Linux's /proc and torch running on more than one thread")
def test_the_writers_summaries_run_on_the_calling_thread_alone():
    # the writer summarises beside the model: torch's own threads would take the model's cores
    import time

    t = torch.randn(8 << 20, generator=torch.Generator().manual_seed(5))
    stats, digest = fingerprint.host_summary(t, chunk=fingerprint.ONE_THREAD_CHUNK)
    assert digest == fingerprint.xxh3_fingerprint(t)
    expected = fingerprint.host_stats(t)
    assert stats[:2] == expected[:2] and stats[4:] == expected[4:]
    assert stats[2:4] == pytest.approx(expected[2:4], rel=1e-6)

    def cpu_seconds_of_others_and_caller(chunk: int) -> tuple[float, float]:
        time.sleep(0.5)  # torch's threads stop spinning after a parallel op
        others, caller = _other_threads_cpu_seconds(), time.thread_time()
        for _ in range(20):
            fingerprint.host_summary(t, chunk=chunk)
        return _other_threads_cpu_seconds() - others, time.thread_time() - caller

    others, caller = cpu_seconds_of_others_and_caller(fingerprint._CHUNK)
    assert others > 0.2 * caller   # the default: torch's threads share the work
    others, caller = cpu_seconds_of_others_and_caller(fingerprint.ONE_THREAD_CHUNK)
    assert others < 0.05 * caller + 0.02   # one clock tick (10 ms) of slack, and a little more
