"""The metrics stage alone, on one core, beside the machine's read bandwidth (issue 32 item 2).

    python benchmarks/metrics_speed.py [--mb 256] [--rounds 3] [--dtypes bfloat16,float32] [--breakdown] [--tree DIR]

A differing pair of each dtype, ``--mb`` MB a side: A is random normal values, B is A with about
half its elements moved by one to three ULPs (what a reduction-order change does), and one
element moved far, so every metric has work. In the calling thread, torch on one thread:

- ``compare_tensors`` exact (mismatches, max abs, mean abs, max rel, ULP and ULP at scale,
  cosine, the worst element), then under ``--atol/--rtol`` and under ``--ulp`` (the tolerance's
  count of elements beyond it, and for ``--ulp`` the tensors' scale first);
- the same with the per-token verdicts (rows of 896 elements: a hidden state's tokens), as
  ``tdiff compare`` measures a pair whose tokens are aligned;

each as GB/s of both sides' bytes over its wall time and over its CPU time (medians of --rounds;
one thread, so the CPU time is the cost on one core even when other processes share the machine),
beside the read bandwidth of one thread over the same bytes (CPU time too): numpy's sum of them as
64-bit words, and their copy. numpy's BLAS (the cosine's dot products) runs on one thread too.
--breakdown also times (CPU time), chunk by chunk over the same pair, the passes the exact
metrics make, each alone over float32 values (the cost of each metric; alone, each pass reads
its chunk from memory, where in the metrics the later passes find it in the cache).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # numpy's dot on one core too (before numpy loads)

import numpy as np
import torch

from _common import machine, median

TARGET_GBPS = 1.0   # issue 32 item 2: per core
HIDDEN = 896


def wall_and_cpu(work) -> tuple[float, float]:
    """Wall and CPU seconds of one call: on a shared machine the CPU time is the cost per core."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def differing_pair(dtype: torch.dtype, mb: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = mb * 2**20 // itemsize // HIDDEN * HIDDEN
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(numel, generator=generator).to(dtype)
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    steps = torch.randint(-3, 4, (numel,), generator=generator, dtype=torch.int64)
    steps[torch.rand(numel, generator=generator) < 0.5] = 0
    b = (a.view(int_type).to(torch.int64) + steps).to(int_type).view(dtype)
    b[numel // 3] = 100.0   # one element far off: the worst element, a large max_abs
    return a.view(-1, HIDDEN), b.view(-1, HIDDEN)


def read_bandwidth(a: torch.Tensor, b: torch.Tensor, rounds: int) -> tuple[float, float]:
    """GB/s of one thread's numpy sum, and copy, over the bytes of both tensors (CPU time)."""
    words = [t.reshape(-1).view(torch.uint8).numpy()[: t.nbytes // 8 * 8].view(np.uint64) for t in (a, b)]
    outs = [np.empty_like(w) for w in words]
    nbytes = sum(w.nbytes for w in words)

    def copy() -> None:
        for w, out in zip(words, outs):
            np.copyto(out, w)

    copy()   # the copies' pages faulted in
    sum_s = median(wall_and_cpu(lambda: [w.sum() for w in words])[1] for _ in range(rounds))
    copy_s = median(wall_and_cpu(copy)[1] for _ in range(rounds))
    return nbytes / sum_s / 1e9, nbytes / copy_s / 1e9


def stages(a: torch.Tensor, b: torch.Tensor):
    """What compare measures of a differing pair: the metrics alone, and with the per-token
    verdicts of a pair whose rows are tokens (as ``tdiff compare`` does for aligned tokens)."""
    from tdiff.compare import metrics, tokens
    from tdiff.compare.metrics import EXACT, Tolerance, compare_tensors

    rows = tokens.TokenRows([tokens.TokenRef(0, 0, i, 0, 0) for i in range(a.shape[0])])

    def with_tokens(tolerance):
        if hasattr(metrics, "measure"):   # one pass (issue 32)
            return lambda: tokens.token_verdict(metrics.measure(a, b, tolerance, by_rows=True).rows_differ, rows)
        return lambda: (tokens.token_verdict(a, b, rows, tolerance), compare_tensors(a, b, tolerance))   # before it

    atol_rtol, ulp = Tolerance(atol=1e-3, rtol=1e-2), Tolerance(ulp=2)
    return {
        "compare exact": lambda: compare_tensors(a, b, EXACT),
        "compare --atol/--rtol": lambda: compare_tensors(a, b, atol_rtol),
        "compare --ulp 2": lambda: compare_tensors(a, b, ulp),
        "+ per-token, exact": with_tokens(EXACT),
        "+ per-token, --atol/--rtol": with_tokens(atol_rtol),
        "+ per-token, --ulp 2": with_tokens(ulp),
    }


def breakdown(a: torch.Tensor, b: torch.Tensor, chunk: int) -> dict[str, float]:
    """Seconds of each pass the metrics make, alone, over the pair in chunks of ``chunk`` elements."""
    int_type = {2: np.int16, 4: np.int32, 8: np.int64}[a.element_size()]
    fa, fb = a.reshape(-1), b.reshape(-1)
    upcast = a.dtype != torch.float32
    values_a, values_b = fa.float().numpy(), fb.float().numpy()   # what the passes after the upcast read
    buffers = {name: np.empty(chunk, np.float32) for name in ("a", "b", "diff", "scale", "magnitude")}
    xor = np.empty(chunk, int_type)
    passes = {
        "bits: xor + count": lambda ca, cb, ba, bb, va, vb: np.count_nonzero(np.bitwise_xor(ba, bb, out=xor[:ba.size])),
        "upcast to float32": lambda ca, cb, ba, bb, va, vb: (torch.from_numpy(buffers["a"][:ca.numel()]).copy_(ca),
                                                              torch.from_numpy(buffers["b"][:ca.numel()]).copy_(cb)),
        "|a-b|": lambda ca, cb, ba, bb, va, vb: np.abs(np.subtract(va, vb, out=buffers["diff"][:va.size]),
                                                       out=buffers["diff"][:va.size]),
        "sum |a-b| (float64)": lambda ca, cb, ba, bb, va, vb: va.sum(dtype=np.float64),
        "argmax |a-b|": lambda ca, cb, ba, bb, va, vb: va.argmax(),
        "cosine: 3 dots": lambda ca, cb, ba, bb, va, vb: (np.dot(va, va), np.dot(vb, vb), np.dot(va, vb)),
        "max(|a|,|b|)": lambda ca, cb, ba, bb, va, vb: np.maximum(np.abs(va, out=buffers["scale"][:va.size]),
                                                                  np.abs(vb, out=buffers["magnitude"][:va.size]),
                                                                  out=buffers["scale"][:va.size]).max(),
        "max rel: min, divide, max": lambda ca, cb, ba, bb, va, vb: (va.min(), np.divide(va, vb, out=buffers["scale"][:va.size]).max()),
        "ULP: sub, abs, max": lambda ca, cb, ba, bb, va, vb: np.abs(np.subtract(ba, bb, out=xor[:ba.size]), out=xor[:ba.size]).max(),
    }
    seconds = {}
    bits_a, bits_b = fa.view(torch.int16 if a.element_size() == 2 else torch.int32).numpy(), \
        fb.view(torch.int16 if b.element_size() == 2 else torch.int32).numpy()
    for name, work in passes.items():
        if name.startswith("upcast") and not upcast:
            continue
        start = time.process_time()
        with np.errstate(all="ignore"):
            for offset in range(0, fa.numel(), chunk):
                ca, cb = fa[offset:offset + chunk], fb[offset:offset + chunk]
                work(ca, cb, bits_a[offset:offset + chunk], bits_b[offset:offset + chunk],
                     values_a[offset:offset + chunk], values_b[offset:offset + chunk])
        seconds[name] = time.process_time() - start
    return seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="MB a side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--breakdown", action="store_true", help="also each pass of the metrics alone")
    parser.add_argument("--tree", help="measure the tdiff of this tree (e.g. another checkout, for a before figure)")
    args = parser.parse_args(argv)
    if args.tree:
        sys.path.insert(0, args.tree)
    torch.set_num_threads(1)
    import tdiff
    from tdiff.compare import metrics

    print(f"metrics stage, one thread; {machine()}; tdiff from {tdiff.__file__}; medians of {args.rounds}")
    for dtype_name in args.dtypes.split(","):
        a, b = differing_pair(getattr(torch, dtype_name), args.mb)
        nbytes = a.nbytes + b.nbytes
        sum_gbps, copy_gbps = read_bandwidth(a, b, args.rounds)
        print(f"\n{dtype_name}: {a.numel():,} elements a side, {nbytes / 1e9:.2f} GB both; read bandwidth, one "
              f"thread: numpy sum {sum_gbps:.2f} GB/s, copy {copy_gbps:.2f} GB/s")
        print(f"  {'':<28} {'wall':>7} {'GB/s':>6} {'CPU':>7} {'GB/s':>6}  per core (CPU time): target >= {TARGET_GBPS} GB/s")
        for label, work in stages(a, b).items():
            walls, cpus = zip(*(wall_and_cpu(work) for _ in range(args.rounds)))
            wall, cpu = median(walls), median(cpus)
            gbps = nbytes / cpu / 1e9
            print(f"  {label:<28} {wall:6.3f}s {nbytes / wall / 1e9:6.2f} {cpu:6.3f}s {gbps:6.2f}  "
                  f"{gbps / sum_gbps:.2f} of the sum's, {'met' if gbps >= TARGET_GBPS else 'MISSED'}")
        if args.breakdown:
            print(f"  passes alone, chunks of {metrics.CHUNK_ELEMENTS:,} elements:")
            for name, seconds in breakdown(a, b, metrics.CHUNK_ELEMENTS).items():
                print(f"    {name:<30} {seconds:7.3f} s {nbytes / seconds / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
