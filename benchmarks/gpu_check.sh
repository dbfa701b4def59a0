#!/usr/bin/env bash
# For whoever gets a CUDA machine: one prepared run of every scheme of recipes/matrix.yaml at small
# sizes on the GPU, printing each scheme's outcome (native / emulated / SKIPPED and why, served,
# tokens/s, KV tokens, PIQA accuracy) and the engine's own support answers for this device.
#   bash benchmarks/gpu_check.sh            (builds the engine-cuda environment on first use)
# Add --write to append the rows to docs/measured-hardware.md (commit them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader || { echo "no NVIDIA GPU visible" >&2; exit 1; }
py="$(python3 pipeline/setup/envs.py engine)"   # engine-cuda.txt on a machine with an NVIDIA GPU
PYTHONPATH="$PWD" "$py" -c "from pipeline import support; import json; print(json.dumps(support.capabilities(), indent=1))"
if [ "${1:-}" = "--write" ]; then
  python3 benchmarks/hardware_matrix.py
else
  python3 benchmarks/hardware_matrix.py --no-write
fi
