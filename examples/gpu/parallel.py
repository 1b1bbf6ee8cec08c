"""megatron-core tensor and expert parallelism against one process, same weights, fp32 (issue 14,
item 5), with the two ranks of each parallel run on ONE device:

    python examples/gpu/parallel.py --out gpu-out/parallel [--device cuda] [--tokens 64]

1. TP=2 vs TP=1, a Qwen2-shaped dense model (tests/stacks/models.py, 2 layers).
2. EP=2 vs EP=1, a Qwen3-MoE-shaped model (4 experts, top-2, allgather dispatcher).

Each run is `tdiff capture -- python -m torch.distributed.run ...` of this script in worker
mode, then `tdiff compare --atol 1e-5`. On a GPU both ranks use cuda:0: NCCL refuses two ranks
on one device, so the two-rank runs try NCCL and, when it fails, say so and run over gloo
(collectives of CUDA tensors staged through host memory). NCCL between two GPUs needs a machine
with two.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

RUNS = (("tp", "qwen2"), ("ep", "qwen3_moe"))


def worker(args) -> None:
    """One rank: Megatron initialised over ``args.backend``, the twin's shard, one forward."""
    import torch.distributed as dist

    from tests.helpers import token_ids
    from tests.stacks.megatron import gpt_forward
    from tests.stacks.models import HF_MODELS, megatron_twin

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    if args.device == "cpu":
        torch.cuda.current_device = lambda: "cpu"  # Megatron asks CUDA for the device (cpu-stacks notes)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    # EP=2 on two ranks: the dense layers tensor-parallel with sequence parallelism, so that each
    # token enters the MoE layer on one rank only; the experts whole on their rank (ETP=1)
    tp, ep = (world, 1) if args.axis == "tp" else (world, world)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1 if ep > 1 else None)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # referenced without TransformerEngine (0.16)
        moe_utils.te_general_gemm = None
    if ep > 1:
        _allow_torch_norms_under_sequence_parallelism()
    model = megatron_twin(HF_MODELS[args.model](getattr(torch, args.dtype)), tensor_parallel=tp,
                          rank=ps.get_tensor_model_parallel_rank(),
                          expert_parallel=ep, expert_rank=ps.get_expert_model_parallel_rank(),
                          **({"sequence_parallel": True} if ep > 1 else {}))
    ids = torch.cat([token_ids(args.tokens, seed=1 + b) for b in range(2)])
    gpt_forward(model.to(args.device), ids.to(args.device))
    dist.destroy_process_group()


def _allow_torch_norms_under_sequence_parallelism() -> None:
    """megatron-core's torch norms (no Apex, no TransformerEngine) refuse sequence parallelism
    because in training their weight gradients would need an all-reduce; a forward pass computes
    the same per-token norms either way."""
    import copy

    from megatron.core.transformer import torch_norm

    build = torch_norm.WrappedTorchNorm.__new__

    def without_sequence_parallel(cls, config, *args, **kwargs):
        config = copy.copy(config)
        config.sequence_parallel = False
        return build(cls, config, *args, **kwargs)

    torch_norm.WrappedTorchNorm.__new__ = without_sequence_parallel


def launch(out: Path, axis: str, model: str, ranks: int, backend: str, dtype: str, args) -> bool:
    """Capture one run into ``out``; its stderr goes to ``out``.log."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "tdiff", "capture", "--force", "--quiet", "--out", str(out), "--",
               sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-port", str(_free_port()), __file__, "--worker", "--axis", axis, "--model", model,
               "--backend", backend, "--dtype", dtype, "--device", args.device, "--tokens", str(args.tokens)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    except subprocess.TimeoutExpired as timeout:  # a collective that never completes
        result = subprocess.CompletedProcess(command, 124, "", f"{timeout.stderr or ''}\ntimed out after 240 s")
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.log").write_text(result.stderr)
    if result.returncode:
        lines = result.stderr.splitlines()
        reason = next((line for line in lines if "Duplicate GPU" in line), None) or next(
            (line for line in reversed(lines) if line.startswith("[rank") and "Error" in line), lines[-1] if lines else "")
        print(f"   {axis.upper()}={ranks} {dtype} over {backend}: failed ({out}.log): {reason.strip()[:400]}")
    return result.returncode == 0


def compare_json(a: Path, b: Path) -> tuple[int, dict]:
    result = subprocess.run([sys.executable, "-m", "tdiff", "compare", str(a), str(b), "--atol", "1e-5", "--json"],
                            capture_output=True, text=True, cwd=REPO)
    try:
        return result.returncode, json.loads(result.stdout)
    except json.JSONDecodeError:
        return result.returncode, {"error": result.stderr[-600:]}


def compare_summary(code: int, report: dict) -> str:
    if "tensors" not in report:
        return f"compare failed (exit {code}): {report.get('error')}"
    tensors = report["tensors"]
    worst = max((t["metrics"]["max_abs"] for t in tensors if t.get("metrics")), default=0.0)
    statuses = {}
    for t in tensors:
        statuses[t["status"]] = statuses.get(t["status"], 0) + 1
    alignment = report.get("alignment", {})
    moe = sorted({t["name"].split(".", 2)[-1] for t in tensors if ".moe." in t["name"]})
    lines = [f"exit {code}: {len(tensors)} tensors, {statuses}, max abs difference {worst:.3g}",
             f"     replicas that differ: {alignment.get('warnings', [])}",
             (f"     unmatched: A {alignment.get('a', {}).get('unmatched', [])}, "
              f"B {alignment.get('b', {}).get('unmatched', [])}"),
             f"     not exposed by the parallel side: {sorted(alignment.get('b', {}).get('not_exposed', {}))}"]
    if moe:
        lines.append(f"     MoE boundaries compared: {', '.join(moe)}")
    if report.get("first_divergence"):
        lines.append(f"     first divergence: {report['first_divergence']['name']}")
    return "\n".join(lines)


def bisect_text(a: Path, b: Path) -> str:
    result = subprocess.run([sys.executable, "-m", "tdiff", "bisect", str(a), str(b)],
                            capture_output=True, text=True, cwd=REPO)
    return f"exit {result.returncode}\n" + "\n".join("     " + line for line in
                                                     (result.stdout or result.stderr).splitlines()[:4])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", default="tp,ep", help="which of tp, ep (comma-separated)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="float32: compare within 1e-5; bfloat16: bisect (comma-separated)")
    parser.add_argument("--backends", help="for the two-rank runs, tried in order (default: nccl,gloo on a "
                                           "GPU, gloo on the CPU)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--axis", choices=["tp", "ep"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.out is None:
        parser.error("--out is required")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"megatron-core parallel runs, both ranks on one {device_name} ({args.device}), 2 x {args.tokens} tokens")
    backends = (args.backends or ("nccl,gloo" if args.device == "cuda" else "gloo")).split(",")
    failed = False
    for axis, model in RUNS:
        if axis not in args.runs.split(","):
            continue
        for dtype in args.dtypes.split(","):
            single, parallel = args.out / f"{axis}1-{dtype}", args.out / f"{axis}2-{dtype}"
            print(f"== {axis.upper()}=2 vs {axis.upper()}=1, {model}, {dtype}")
            if not launch(single, axis, model, 1, "nccl" if args.device == "cuda" else "gloo", dtype, args):
                failed = True
                continue
            backend = next((b for b in backends if launch(parallel, axis, model, 2, b, dtype, args)), None)
            if backend is None:
                failed = True
                continue
            backends = backends[backends.index(backend):]  # a refusal once is a refusal for every run
            if dtype == "float32":
                code, report = compare_json(single, parallel)
                print(f"   over {backend}: tdiff compare --atol 1e-5: {compare_summary(code, report)}")
                failed = failed or code != 0
            else:
                print(f"   over {backend}: tdiff bisect: {bisect_text(single, parallel)}")
    return 1 if failed else 0


def _free_port() -> int:
    from tests.stacks import free_port

    return free_port()


if __name__ == "__main__":
    sys.exit(main())
