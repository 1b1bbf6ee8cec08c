#!/usr/bin/env bash
# Create .venv (or $TDIFF_VENV) with tdiff and everything its demo and tests use. Idempotent:
# a stamp of the requirement files skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

# Headless Chromium (Debian's package) renders the HTML report in the tests. Root (as in CI)
# installs it; anyone else is told how.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: apt-get install chromium" >&2
    apt_log=$(mktemp)
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
      >"$apt_log" 2>&1 || { cat "$apt_log" >&2; echo "setup: apt-get install chromium failed" >&2; exit 1; }
    rm -f "$apt_log"
  else
    echo "setup: warning: chromium is missing; the HTML report tests need it (apt-get install chromium)" >&2
  fi
fi

# compare's compiled pass (tdiff/compare/compiled.py), for any processor and, on x86-64, for those
# with AVX2 (x86-64-v3), which it picks where the processor has them; without it compare measures
# every tensor with numpy, slower on many threads. Not -march=native: a folder shared by machines
# of other processors (a cluster's home) would crash on them.
kernel=tdiff/compare/measure_kernel
builds=("$kernel.so:")
[ "$(uname -m)" = x86_64 ] && builds+=("$kernel.x86-64-v3.so:-march=x86-64-v3")
for build in "${builds[@]}"; do
  library=${build%%:*} flags=${build#*:}
  if [ ! -f "$library" ] || [ "$kernel.c" -nt "$library" ]; then
    echo "setup: cc $flags $kernel.c" >&2
    # shellcheck disable=SC2086  # no flags for the build for any processor
    cc -O3 $flags -ffp-contract=off -shared -fPIC -o "$library" "$kernel.c" \
      || echo "setup: warning: $library did not build; compare measures with numpy where no build fits" >&2
  fi
done

venv="${TDIFF_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.tdiff-setup"
digest=$(cat pyproject.toml requirements/*.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ]; then
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
log="$venv/.tdiff-setup.log"
pip_install() {  # pip's output goes to the log, and is shown when pip fails
  echo "setup: pip install $*" >&2
  pip install "$@" >"$log" 2>&1 || { cat "$log" >&2; echo "setup: pip install failed" >&2; exit 1; }
}
# the distribution was called `tdiff` until it became torch-tdiff: drop an install under the old
# name, so that one distribution owns the package and the `tdiff` command
if pip show --quiet tdiff >/dev/null 2>&1; then
  echo "setup: pip uninstall tdiff (now torch-tdiff)" >&2
  pip uninstall --yes tdiff >"$log" 2>&1 || { cat "$log" >&2; echo "setup: pip uninstall failed" >&2; exit 1; }
fi
# torch first and pinned: the CPU build from local disk, never a CUDA download
python -c "import torch" 2>/dev/null || pip_install torch==2.13.0
pip_install -c requirements/constraints.txt -e ".[test,hf,megatron,report]"
pip_install -c requirements/constraints.txt --no-deps sglang
pip_install -c requirements/constraints.txt -r requirements/sglang-cpu.txt
python -c "import tdiff, torch, transformers, megatron.core, sglang, safetensors, h5py" \
  || { echo "setup: the environment in $venv is incomplete" >&2; exit 1; }
echo "$digest" > "$stamp"
