"""The cost of op records (`tdiff capture --ops`) on the Qwen2-shaped model of issue 7.

    python benchmarks/ops_overhead.py [--rounds 5] [--tokens 256] [--layers 8] [--work /tmp/tdiff-bench]

Variants, interleaved round by round (medians are printed), each timed until the dump is on disk:
  plain              the forward alone
  stats              tdiff.capture(mode="stats"): every module boundary, no op records
  stats + 1 attn     the same, with --ops for one layer's self_attn (what online bisect records)
  stats + 1 layer    --ops for one decoder layer and every module in it
  stats + all        --ops for every module of the model

Op records cost only inside the selected modules: the dispatch mode is active only while their
forward runs, and paused while their children run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from _common import dir_bytes, fresh_dir, input_ids, machine, median, qwen2_model, timed

VARIANTS = {
    "plain": None,
    "stats": ("stats", ()),
    "stats + 1 attn": ("stats", (r"^model\.layers\.3\.self_attn$",)),
    "stats + 1 layer": ("stats", (r"^model\.layers\.3(\.|$)",)),
    "stats + all": ("stats", (r"",)),
}


def run(variant, model, ids, work: Path) -> dict:
    if variant is None:
        return {"seconds": timed(lambda: model(ids)), "ops": 0, "bytes": 0}
    import tdiff
    from tdiff.store import open_dump

    mode, ops = variant
    out = fresh_dir(work / "ops-bench")
    capture = tdiff.capture(out, mode=mode, ops=ops).start()
    seconds = timed(lambda: model(ids)) + timed(capture.stop)
    return {"seconds": seconds, "ops": len(open_dump(out).ops), "bytes": dir_bytes(out)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--work", type=Path, default=Path("/tmp/tdiff-bench"))
    args = parser.parse_args(argv)

    model = qwen2_model(args.layers)
    ids = input_ids(args.tokens)
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with torch.no_grad():
        for variant in VARIANTS.values():  # warm-up: allocator, imports, page cache
            run(variant, model, ids, args.work)
        for _ in range(args.rounds):
            for name, variant in VARIANTS.items():
                results[name].append(run(variant, model, ids, args.work))

    plain = median(r["seconds"] for r in results["plain"])
    stats = median(r["seconds"] for r in results["stats"])
    print(f"op records, {args.layers}-layer Qwen2 shape, {args.tokens} tokens, fp32; {machine()}")
    print(f"medians of {args.rounds} interleaved rounds, until on disk\n")
    print(f"{'variant':<16} {'seconds':>8} {'x plain':>8} {'x stats':>8} {'op records':>11} {'MB':>8}")
    for name, rows in results.items():
        seconds = median(r["seconds"] for r in rows)
        print(f"{name:<16} {seconds:8.3f} {seconds / plain:8.2f} {seconds / stats:8.2f} "
              f"{rows[0]['ops']:11d} {median(r['bytes'] for r in rows) / 1e6:8.1f}")


if __name__ == "__main__":
    main()
