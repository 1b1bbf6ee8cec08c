#!/usr/bin/env bash
# Static checks (CI runs them before the tests): ruff on the whole tree, mypy on tdiff/ and
# examples/zoo/, and import-linter's layering contracts (pyproject.toml, docs/ARCHITECTURE.md).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. "${TDIFF_VENV:-.venv}/bin/activate"
echo "lint: ruff check ." >&2
ruff check .
echo "lint: mypy (tdiff/, examples/zoo/)" >&2
mypy
echo "lint: lint-imports" >&2
lint-imports
