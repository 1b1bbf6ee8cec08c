"""Throughput of stats mode's per-tensor summary on the GPU: the fused Triton kernel (statistics
and the fingerprint in one pass) and the torch-ops fallback, against a plain read of the tensor
(``torch.sum``) as the memory-bandwidth reference.

    python benchmarks/gpu/summary_kernel.py [--sizes 1M,16M,256M] [--dtype bfloat16]

Times are CUDA-event medians of 20 launches after a warm-up; GB/s counts the tensor's bytes.
Then the host's cost per summary of a small tensor (128 x 896, a 1 x 128 forward's hidden state),
where capture's stats mode spends it: one launch per tensor against one launch per group of 8.
Last, the GPU time a small tensor's summary adds to a CUDA graph (decode-step hidden states of 1,
32 and 256 tokens), beside a node that does nothing and a ``torch.sum`` node: a graph's replay
waits for each summary in turn, so latency, not bandwidth, is what they cost there.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import triton
import triton.language as tl

from tdiff.store.device_summary import GROUP, fused_summary, fused_summary_into, group_summary_into, new_partials

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


@triton.jit
def _nothing(flag):
    tl.store(flag, 1)


def graph_microseconds_per_node(launch_all, nodes: int, replays: int = 50) -> float:
    """GPU time per node of a graph captured from ``launch_all`` (``nodes`` launches), as the
    median replay's CUDA-event time over the nodes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and warms up off the capture
        launch_all()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_all()
    return cuda_median(graph.replay, replays) * 1e6 / nodes


def small_summaries_in_a_graph(dtype, hidden: int = 896, nodes: int = 120) -> None:
    print(f"GPU time per node of a CUDA graph of {nodes} (us), one small tensor each:")
    print(f"  {'tokens':>6} {'elements':>9} {'no-op node':>11} {'torch.sum':>10} {'tdiff summary':>14}")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    for tokens in (1, 32, 256):
        tensors = [torch.randn(tokens * hidden, device="cuda").to(dtype) for _ in range(nodes)]
        table = torch.empty(nodes, 7, dtype=torch.float64, device="cuda")
        counters = torch.zeros(nodes, 1, dtype=torch.int32, device="cuda")
        partials = new_partials(torch.device("cuda", torch.cuda.current_device()), dtype)

        def summaries(tensors=tensors, table=table, counters=counters, partials=partials):
            for i, t in enumerate(tensors):
                group_summary_into([t], table, counters, i, partials)

        cells = [graph_microseconds_per_node(fn, nodes) for fn in (
            lambda: [_nothing[(1,)](flag) for _ in range(nodes)],
            lambda tensors=tensors: [t.sum() for t in tensors],
            summaries)]
        print(f"  {tokens:>6} {tokens * hidden:>9,} {cells[0]:>11.2f} {cells[1]:>10.2f} {cells[2]:>14.2f}")


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
    small_summaries_in_a_graph(dtype)


if __name__ == "__main__":
    main()
