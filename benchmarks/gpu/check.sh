#!/usr/bin/env bash
# The GPU device check: one prepared run on a machine with an NVIDIA GPU that installs nothing from
# the network. See README.md here for what it measures and which wheels to carry.
#   bash benchmarks/gpu/check.sh            # everything (7 minutes on an H200, measured)
#   bash benchmarks/gpu/check.sh --quick    # kernels, decode timing and swap only
#   TRITON_INTERPRET=1 bash benchmarks/gpu/check.sh --smoke   # the script itself, on a CPU, tiny shapes
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pagedserve-gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ "${1:-}" = "--smoke" ] && PYTHON=.venv/bin/python
$PYTHON benchmarks/gpu/check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/check.log"
exit "${PIPESTATUS[0]}"
