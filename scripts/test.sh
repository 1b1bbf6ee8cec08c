#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. "${TDIFF_VENV:-.venv}/bin/activate"
exec python -m pytest -q "$@"
