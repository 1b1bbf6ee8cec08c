#!/usr/bin/env bash
# Everything of docs/GPU.md on one CUDA GPU, in one command (about 8 minutes on an H200):
#   bash examples/gpu/run_all.sh [OUT]
# 1. batch invariance: one sequence alone vs inside a batch of 8 -> compare, bisect, patch try, report
# 2. megatron-core vs transformers with the same weights (bf16) -> compare, bisect
# 3. capture overhead of stats and full mode against .cpu() + torch.save per tensor
# 4. megatron-core TP=2 vs TP=1 and EP=2 vs EP=1, both ranks on this one GPU (fp32 compare, bf16 bisect)
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-gpu-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
tdiff() { python3 -m tdiff "$@"; }
score="python3 examples/gpu/batch_invariance.py ${SCORE_OPTIONS:-}"

echo "== 1. batch invariance"
tdiff capture --force --quiet --out "$out/alone" --side alone -- $score
tdiff capture --force --quiet --out "$out/batched" --side "row 3 of 8" --batch-row 3 -- $score --batch 8
tdiff compare "$out/alone" "$out/batched" --top 8
tdiff bisect "$out/alone" "$out/batched" --json > "$out/batch_bisect.json"
tdiff bisect "$out/alone" "$out/batched"
rm -rf "$out/try"
timeout 330 python3 -m tdiff patch try --json --workdir "$out/try" \
  --candidates builtin:batch-invariant-matmul,batch-invariant-mean,batch-invariant-log-softmax,batch-invariant \
  --baseline "$out/alone" --rerun-baseline "$score" --batch-row 3 -- $score --batch 8 > "$out/batch_try.json"
echo "patch try exit status: $?"
python3 - "$out/batch_try.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for run in [report["control"], *report["candidates"]]:
    first = run["first_divergence"]
    print(f"  {run['name']:<30} {run['status']:<9} first divergence: {first['name'] if first else '-'}"
          f"  mismatched tensors: {run['mismatched']}  max ULP: {run['max_ulp']}")
print("  best:", report["best"])
PY
tdiff report "$out/alone" "$out/batched" --bisect --patch-results "$out/batch_try.json" --quiet \
  -o "$out/batch_report.md"

echo "== 2. megatron-core vs transformers (bf16, same weights)"
python3 examples/gpu/megatron_vs_hf.py --out "$out/mvh" --layers 4 --tokens 128 2>&1 | grep -v -i warn
tdiff compare "$out/mvh/hf" "$out/mvh/megatron" --top 8
tdiff bisect "$out/mvh/hf" "$out/mvh/megatron" --json > "$out/mvh_bisect.json"
tdiff bisect "$out/mvh/hf" "$out/mvh/megatron"

echo "== 3. capture overhead"
python3 benchmarks/gpu/capture_overhead.py --rounds 2 --shapes 1x128,8x512 2>&1 | grep -v -i warn

echo "== 4. tensor and expert parallelism, both ranks on one GPU"
python3 examples/gpu/parallel.py --out "$out/parallel" 2>&1 | grep -v -i warn
