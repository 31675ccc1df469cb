# Sourced by the gpu_*.sh scripts: $OUT for logs, the bundled site-packages unpacked and on
# PYTHONPATH with the packages' sources, and the GPU's name and clocks recorded.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/site.tar.xz
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/smi.txt"
