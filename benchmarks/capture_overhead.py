"""Capture overhead on the Qwen2-shaped model of issue 7, side by side in one run.

    python benchmarks/capture_overhead.py [--rounds 5] [--tokens 256] [--work /tmp/tdiff-bench]

Variants, interleaved round by round (medians are printed):
  plain           the forward alone
  tdiff stats     tdiff.capture(mode="stats"): fingerprints and statistics per tensor
  tdiff full      tdiff.capture(mode="full"): host tensors written into their shard at the hook
  sglang dumper   SGLang's dumper, non_intrusive_mode="all" (one torch.save per tensor)
  torch.save hook a forward hook that torch.saves every input and output tensor

"forward" is the time until the model returns (what the run experiences); "to disk" adds the
wait until tdiff's background writer has written everything (sglang and the hook dumper write
synchronously, so for them the two are the same).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from _common import dir_bytes, fresh_dir, input_ids, machine, median, page_cache_bandwidth, qwen2_model, \
    save_every_tensor, timed

TARGET_STATS = 1.15   # issue 7, on this project's 2-core machine
TARGET_STATS_ANY_CORES = 1.3   # issue 30, on 2 cores and on the GPU machine's 16
TARGET_FULL_SHARE = 1 / 3
TARGET_DISK = 0.7


def run_plain(model, ids, work):
    return {"forward": timed(lambda: model(ids))}


def run_tdiff(mode):
    def run(model, ids, work):
        import tdiff

        out = fresh_dir(work / f"tdiff-{mode}")
        capture = tdiff.capture(out, mode=mode).start()
        forward = timed(lambda: model(ids))
        total = forward + timed(capture.stop)
        return {"forward": forward, "to disk": total, "bytes": dir_bytes(out)}

    return run


def run_sglang_dumper(model, ids, work):
    from tests.stacks.sglang import install_import_shims

    install_import_shims()
    from sglang.srt.debug_utils.dumper import dumper

    out = fresh_dir(work / "sglang")
    dumper.configure(enable=True, dir=str(out), exp_name="bench", non_intrusive_mode="all",
                     enable_output_console=False)
    dumper.register_non_intrusive_dumper(model)
    try:
        forward = timed(lambda: (model(ids), dumper.step()))
    finally:
        dumper.reset()
        dumper.configure(enable=False)
    return {"forward": forward, "to disk": forward, "bytes": dir_bytes(out)}


def run_torch_save_hook(model, ids, work):
    out = fresh_dir(work / "hook")
    handles = save_every_tensor(model, out)
    try:
        forward = timed(lambda: model(ids))
    finally:
        for h in handles:
            h.remove()
    return {"forward": forward, "to disk": forward, "bytes": dir_bytes(out)}


VARIANTS = {"plain": run_plain, "tdiff stats": run_tdiff("stats"), "tdiff full": run_tdiff("full"),
            "sglang dumper": run_sglang_dumper, "torch.save hook": run_torch_save_hook}


def raw_bytes(model, ids, work) -> tuple[int, int, int]:
    """Bytes of every recorded input/output (as SGLang's "all" mode sees them), and the distinct ones."""
    import tdiff
    from tdiff.store import open_dump

    out = fresh_dir(work / "raw")
    with tdiff.capture(out):
        model(ids)
    dump = open_dump(out)
    nbytes = [r.numel * torch.empty((), dtype=getattr(torch, r.dtype)).element_size() for r in dump.records]
    distinct = sum(n for n, r in zip(nbytes, dump.records) if r.alias_of is None)
    return len(dump.records), sum(nbytes), distinct


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--work", type=Path, default=Path("/tmp/tdiff-bench"))
    args = parser.parse_args(argv)

    model = qwen2_model(args.layers)
    ids = input_ids(args.tokens)
    bandwidth = page_cache_bandwidth(args.work)
    with torch.no_grad():
        records, raw, distinct = raw_bytes(model, ids, args.work)
        for run in VARIANTS.values():  # warm-up: allocator, imports, page cache
            run(model, ids, args.work)
        results = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, run in VARIANTS.items():
                results[name].append(run(model, ids, args.work))

    plain = median(r["forward"] for r in results["plain"])
    print(f"capture overhead, {args.layers}-layer Qwen2 shape, {args.tokens} tokens, fp32; {machine()}")
    print(f"{records} recorded tensors, {raw / 1e6:.0f} MB raw per forward, {distinct / 1e6:.0f} MB distinct; "
          f"medians of {args.rounds} interleaved rounds; page-cache write bandwidth (one thread) "
          f"{bandwidth / 1e9:.2f} GB/s\n")
    print(f"{'variant':<16} {'forward s':>10} {'x plain':>8} {'to disk s':>10} {'x plain':>8} {'disk/raw':>9}")
    summary = {}
    for name, rows in results.items():
        forward = median(r["forward"] for r in rows)
        to_disk = median(r.get("to disk", r["forward"]) for r in rows)
        size = median(r.get("bytes", 0) for r in rows)
        summary[name] = (forward, to_disk, size)
        disk = f"{size / raw:9.3f}" if size else f"{'-':>9}"
        print(f"{name:<16} {forward:10.3f} {forward / plain:8.2f} {to_disk:10.3f} {to_disk / plain:8.2f} {disk}")

    sglang_overhead = summary["sglang dumper"][0] - plain
    full_overhead = summary["tdiff full"][0] - plain
    full_overhead_to_disk = summary["tdiff full"][1] - plain
    stats_ratio = summary["tdiff stats"][1] / plain
    print("\nbounds (issues 7 and 18):")
    print(f"  stats mode <= {TARGET_STATS}x plain:                       {stats_ratio:.3f}x  "
          f"{'met' if stats_ratio <= TARGET_STATS else 'MISSED'}  (overhead {summary['tdiff stats'][1] - plain:.3f} s, "
          f"bound {(TARGET_STATS - 1) * plain:.3f} s)")
    print(f"  stats mode <= {TARGET_STATS_ANY_CORES}x plain (issue 30, any core count):   {stats_ratio:.3f}x  "
          f"{'met' if stats_ratio <= TARGET_STATS_ANY_CORES else 'MISSED'}")
    share = full_overhead_to_disk / sglang_overhead
    print(f"  full-mode overhead until on disk <= 1/3 of sglang's: {full_overhead_to_disk:.3f} s vs "
          f"{sglang_overhead:.3f} s = {share:.2f}  {'met' if share <= TARGET_FULL_SHARE else 'MISSED'}  "
          f"(bound {sglang_overhead * TARGET_FULL_SHARE:.3f} s)")
    print(f"  (full-mode overhead, forward only:                  {full_overhead:.3f} s "
          f"= {full_overhead / sglang_overhead:.2f} of sglang's)")
    floor = summary["tdiff full"][2] / bandwidth
    print(f"  (the page-cache floor: the full dump's {summary['tdiff full'][2] / 1e6:.0f} MB handed to the OS by one "
          f"thread take {floor:.3f} s = {floor / sglang_overhead:.2f} of sglang's overhead)")
    disk_ratio = summary["tdiff full"][2] / raw
    print(f"  on-disk bytes <= {TARGET_DISK} x raw:                       {disk_ratio:.3f}  "
          f"{'met' if disk_ratio <= TARGET_DISK else 'MISSED'}")


if __name__ == "__main__":
    main()
