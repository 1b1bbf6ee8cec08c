#!/usr/bin/env bash
# Set up (if needed) and run the divergence zoo (docs/ZOO.md): every class of the DeepSeek-V4
# true-on-policy work planted in a tiny model, each side captured with `tdiff capture` and the pair
# bisected with `tdiff bisect --json`; prints the table. Arguments go to `python -m examples.zoo`
# (class names, --out DIR, --json FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. "${TDIFF_VENV:-.venv}/bin/activate"
exec python -m examples.zoo "$@"
