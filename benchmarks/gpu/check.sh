#!/usr/bin/env bash
# The GPU check in one command, on a lent GPU machine (`make gpu-check` runs it locally):
# unpacks gpu-kit/wheels (`make gpu-kit`), runs tests/gpu, then the GPU benchmarks
# (benchmarks/gpu/check.py), and writes check.json, check.md and check.log into $OUT
# (default runs/gpu-check). It stops itself within TIDAL_GPU_CHECK_LIMIT_S (default 470 s: the
# steps get 20 s less, the rest is for writing). Extra arguments go to check.py
# (e.g. --steps decode,sleep_wake; --device cpu --sizes tiny for a dry run).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-$root/runs/gpu-check}
limit=${TIDAL_GPU_CHECK_LIMIT_S:-470}
python=${PYTHON:-}
if [ -z "$python" ]; then  # the interpreter that has torch (python3 or python)
    for p in python3 python; do
        if command -v "$p" >/dev/null && "$p" -c "import torch" 2>/dev/null; then
            python=$p
            break
        fi
    done
fi
if [ -z "$python" ]; then
    echo "check.sh: no python3 or python with torch on PATH (set PYTHON)" >&2
    exit 2
fi
mkdir -p "$out"
cd "$root" || exit 1
timeout -k 10 "$limit" "$python" benchmarks/gpu/check.py --out "$out" \
    --limit-s $((limit - 20)) "$@" 2>&1 | tee "$out/check.log"
exit "${PIPESTATUS[0]}"
