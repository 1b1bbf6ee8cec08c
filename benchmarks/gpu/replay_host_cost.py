"""Host CPU time tdiff spends on each CUDA graph replay in stats mode, on graph_replay.py's model
(24 RMSNorm + MLP blocks of Qwen2-0.5B's widths, bf16, 32 tokens).

    python benchmarks/gpu/replay_host_cost.py [--replays 200]

The device is synchronised after each replay and the writer given 2 ms, so no thread spins on
the GPU: what is left is work. Printed per replay, without capture and under `--mode stats`: the
wall time of `CUDAGraph.replay()` (tdiff's harvest runs inside it), its CPU time, and the CPU time
of every other thread (tdiff's writer and shard writers). The GPU's share of a replay is
graph_replay.py's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/_common (it adds the repo)
sys.path.insert(0, str(Path(__file__).resolve().parent))      # graph_replay's model

from _common import fresh_dir
from graph_replay import HIDDEN, LAYERS, Block, captured_graph

import tdiff


def measure(model, x, mode: str | None, replays: int, out: Path) -> tuple[float, float, float]:
    capture = tdiff.capture(fresh_dir(out), mode=mode).start() if mode else None
    graph = captured_graph(model, x)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    time.sleep(0.2)
    wall = replay_cpu = other_cpu = 0.0
    for _ in range(replays):
        process, thread, start = time.process_time(), time.thread_time(), time.perf_counter()
        graph.replay()
        wall += time.perf_counter() - start
        replay_cpu += time.thread_time() - thread
        torch.cuda.synchronize()
        time.sleep(0.002)   # the writer's turn
        other_cpu += (time.process_time() - process) - (time.thread_time() - thread)
    if capture:
        capture.stop()
    return wall / replays * 1e6, replay_cpu / replays * 1e6, other_cpu / replays * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("/tmp/tdiff-replay-host"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(LAYERS)]).cuda().bfloat16()
    x = torch.randn(32, HIDDEN, device="cuda", dtype=torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.replays} replays")
    print(f"{'capture':8s} {'replay() us':>12s} {'its CPU us':>11s} {'other threads CPU us':>21s}")
    with torch.no_grad():
        for mode in (None, "stats"):
            wall, replay_cpu, other_cpu = measure(model, x, mode, args.replays, args.out)
            print(f"{mode or 'none':8s} {wall:12.1f} {replay_cpu:11.1f} {other_cpu:21.1f}")


if __name__ == "__main__":
    main()
