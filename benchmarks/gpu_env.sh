# Sourced by the gpu_*.sh scripts: $OUT for logs, the bundled site-packages unpacked and on
# PYTHONPATH with the packages' sources, and the GPU's name and clocks recorded.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
# unpacked once per bundle: the family scripts of one session share it
if [ ! -f /tmp/site/.unpacked ] || [ .gpu/site.tar.xz -nt /tmp/site/.unpacked ]; then
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/site.tar.xz && touch /tmp/site/.unpacked
fi
# GPU_EXTRA_PATH: directories put before the bundle (another version of a peer, e.g. the
# Liger-Kernel release that supports the bundle's transformers)
export PYTHONPATH=${GPU_EXTRA_PATH:+$GPU_EXTRA_PATH:}/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/smi.txt"
