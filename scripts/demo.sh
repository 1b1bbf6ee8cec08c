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

step "capture the reference run"
tdiff capture --force --out "$out/a" --side reference -- python examples/demo/run.py
step "capture the run with the planted divergence"
tdiff capture --force --out "$out/b" --side planted -- python examples/demo/run.py --planted

step "compare (exit 1: a divergence is expected)"
status=0
tdiff compare "$out/a" "$out/b" --top 10 || status=$?
[ "$status" -eq 1 ] || { echo "demo: expected compare to find the divergence (exit 1), got $status" >&2; exit 1; }

step "report for a pull request (Markdown) and as one HTML page with plots"
for format in md html; do
  status=0
  tdiff report "$out/a" "$out/b" --format "$format" -o "$out/report.$format" || status=$?
  [ "$status" -eq 1 ] || { echo "demo: expected report to find the divergence (exit 1), got $status" >&2; exit 1; }
done

echo
echo "demo: done; dumps are in $out/, reports in $out/report.md and $out/report.html"
