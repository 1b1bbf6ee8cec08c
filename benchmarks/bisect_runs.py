"""Bisect cost: runs per side against the number of boundaries searched (issue 7, target 3).

    python benchmarks/bisect_runs.py [--layers 2,4,8,16] [--planted-layer 1]

For each depth, the demo model (examples/demo/run.py) with its planted bf16 RMSNorm variance is
bisected online with the stats pass disabled (`tdiff bisect --run-a ... --run-b ...
--no-stats-pass`): a binary search over boundaries with one selective capture per probe. Printed:
boundaries, runs per side, the bound ceil(log2(boundaries)) + 2, the culprit named, and the time.
The planted norm is a module's own code, so both sides then run once more to record its ops (the
"ops" column, outside the bound; docs/BISECT.md).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

from _common import REPO, machine

DEMO = REPO / "examples" / "demo" / "run.py"


def bisect(layers: int) -> tuple[dict, float]:
    run = f"{sys.executable} {DEMO} --layers {layers}"
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "tdiff", "bisect", "--run-a", run, "--run-b", f"{run} --planted",
                             "--no-stats-pass", "--json"], capture_output=True, text=True, cwd=REPO)
    if result.returncode != 1:
        raise SystemExit(f"bisect of {layers} layers exited {result.returncode}: {result.stderr[-2000:]}")
    return json.loads(result.stdout), time.perf_counter() - started


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,4,8,16")
    args = parser.parse_args(argv)
    print(f"online bisection without the stats pass, demo model, planted fault in layer 1; {machine()}\n")
    print(f"{'layers':>6} {'boundaries':>10} {'runs A':>7} {'runs B':>7} {'bound':>6}  {'ops':>4} {'seconds':>8}  "
          "culprit")
    for layers in (int(n) for n in args.layers.split(",")):
        found, seconds = bisect(layers)
        runs = found["runs"]
        n = runs["boundaries"]
        bound = math.ceil(math.log2(n)) + 2
        first = found["first_divergence"]
        ops = sum(1 for run in runs["log"] if run["purpose"] == "ops" and run["side"] == "A")
        search_a, search_b = runs["a"] - ops, runs["b"] - ops
        ok = "ok" if max(search_a, search_b) <= bound else "OVER"
        op = first["op"]
        named = f", op {op['name_b']} in {op['function_b']} ({op['source_b']})" if op else ""
        print(f"{layers:>6} {n:>10} {search_a:>7} {search_b:>7} {bound:>6} {ok:>3} {ops:>4} {seconds:7.1f}  "
              f"{first['module']} ({first['kind']}){named}")


if __name__ == "__main__":
    main()
