#!/usr/bin/env bash
# Set up (if needed) and run the main job on the bundled example: capture a reference run and a
# run with a planted divergence, compare them, bisect to the op that introduces the divergence,
# and write reports. Outputs go to demo-out/ (or $1).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. "${TDIFF_VENV:-.venv}/bin/activate"
out="${1:-demo-out}"
mkdir -p "$out"

step() { printf '\n== %s\n' "$*"; }

step "capture the reference run (--params: each module's parameters, for bisect's exact replay of the culprit)"
tdiff capture --force --params --out "$out/a" --side reference -- python examples/demo/run.py
step "capture the run with the planted divergence"
tdiff capture --force --params --out "$out/b" --side planted -- python examples/demo/run.py --planted

step "compare (exit 1: a divergence is expected)"
status=0
tdiff compare "$out/a" "$out/b" --top 10 || status=$?
[ "$status" -eq 1 ] || { echo "demo: expected compare to find the divergence (exit 1), got $status" >&2; exit 1; }

step "bisect: name the op that introduces the divergence (exit 1 expected)"
status=0
tdiff bisect "$out/a" "$out/b" || status=$?
[ "$status" -eq 1 ] || { echo "demo: expected bisect to find the divergence (exit 1), got $status" >&2; exit 1; }
tdiff bisect "$out/a" "$out/b" --json > "$out/bisect.json" || true
python - "$out/bisect.json" <<'PY'
import json, sys
first = json.load(open(sys.argv[1]))["first_divergence"]
named = (first["module"], first["kind"])
expected = ("model.layers.1.post_attention_layernorm", "norm")
if named != expected:
    sys.exit(f"demo: bisect named {named}, expected {expected}")
print(f"demo: bisect named {named[0]} (kind {named[1]}), the planted op")
PY

step "report for a pull request (Markdown) and as one HTML page with plots, with the bisect result"
for format in md html; do
  status=0
  tdiff report "$out/a" "$out/b" --bisect --format "$format" -o "$out/report.$format" || status=$?
  [ "$status" -eq 1 ] || { echo "demo: expected report to find the divergence (exit 1), got $status" >&2; exit 1; }
done

echo
echo "demo: done; dumps are in $out/, reports in $out/report.md and $out/report.html"
