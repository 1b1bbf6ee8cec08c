"""Throughput of stats mode's per-tensor summary on the GPU: the fused Triton kernel (statistics
and the fingerprint in one pass) and the torch-ops fallback, against a plain read of the tensor
(``torch.sum``) as the memory-bandwidth reference.

    python benchmarks/gpu/summary_kernel.py [--sizes 1M,16M,256M] [--dtype bfloat16]

Times are CUDA-event medians of 20 launches after a warm-up; GB/s counts the tensor's bytes.
Then the host's cost per summary of a small tensor (128 x 896, a 1 x 128 forward's hidden state),
where capture's stats mode spends it: one launch per tensor against one launch per group of 8.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch

import time

from tdiff.store.device_summary import GROUP, fused_summary, fused_summary_into, group_summary_into

try:  # the torch-ops fingerprint of this version of tdiff (mix64; wsum64 before it)
    from tdiff.store.fingerprint import mix64_fingerprint_tensor as torch_fingerprint
except ImportError:
    from tdiff.store.fingerprint import wsum64_fingerprint_tensor as torch_fingerprint


def cuda_median(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def host_cost_per_tensor(dtype, repeats: int = 500) -> tuple[float, float]:
    """Host seconds per summarised tensor: each in its own launch, and in launches of GROUP."""
    tensors = [torch.randn(128, 896, device="cuda").to(dtype) for _ in range(GROUP)]
    table = torch.empty(GROUP, 7, dtype=torch.float64, device="cuda")
    counters = torch.zeros(GROUP, 1, dtype=torch.int32, device="cuda")

    def single():
        for i, t in enumerate(tensors):
            fused_summary_into(t, table[i], counters[i])

    def grouped():
        group_summary_into(tensors, table, counters, 0)

    costs = []
    for fn in (single, grouped):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        costs.append((time.perf_counter() - start) / repeats / GROUP)
        torch.cuda.synchronize()
    return costs[0], costs[1]


def elements(text: str) -> int:
    return int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]] if text[-1] in "KMG" else int(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,16M,256M", help="elements, comma-separated (K, M, G suffixes)")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"stats-mode summary on {torch.cuda.get_device_name()}, {args.dtype}, torch {torch.__version__}")
    print(f"  {'elements':>10} {'MiB':>8} {'read (sum)':>16} {'fused kernel':>18} {'torch fingerprint':>20}")
    for size in args.sizes.split(","):
        t = torch.randn(elements(size), device="cuda").to(dtype)
        nbytes = t.numel() * t.element_size()
        cells = []
        for fn in (t.sum, partial(fused_summary, t), partial(torch_fingerprint, t)):
            seconds = cuda_median(fn)
            cells.append(f"{seconds * 1e3:8.3f} ms {nbytes / seconds / 1e9:5.0f} GB/s")
        print(f"  {t.numel():>10,} {nbytes / 2**20:8.1f} {cells[0]:>16} {cells[1]:>18} {cells[2]:>20}")
    single, grouped = host_cost_per_tensor(dtype)
    print(f"host cost per summary of a 128 x 896 tensor: {single * 1e6:.1f} us in its own launch, "
          f"{grouped * 1e6:.1f} us in launches of {GROUP}")


if __name__ == "__main__":
    main()
