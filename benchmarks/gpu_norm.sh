#!/usr/bin/env bash
# One GPU session for the norm ops: unpack the bundle, prebuild kernels in parallel, run the
# cuda tests, then the benchmark. Logs go to $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/site.tar.xz
export PYTHONPATH=/tmp/site:$(ls -d $PWD/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/smi.txt"
python3 benchmarks/prebuild_norm.py --workers 14 2>&1 | grep -v "TileLang" | tee "$OUT/prebuild.log" | tail -5
python3 -m pytest -m cuda tests/ops -x -q -p no:cacheprovider 2>&1 | tail -n 30 | tee "$OUT/pytest.log"
python3 benchmarks/norm.py ${NORM_ARGS:-} --out "$OUT" 2>&1 | grep -v "TileLang" | tee "$OUT/bench.log" | tail -n 45
