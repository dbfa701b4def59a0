#!/usr/bin/env bash
# For whoever gets a CUDA machine: one prepared run of every scheme of recipes/matrix.yaml at small
# sizes on the GPU, printing each scheme's outcome (native / emulated / SKIPPED and why, served,
# second engine agrees, tokens/s, KV tokens, PIQA accuracy) and the engine's own support answers.
#   bash benchmarks/gpu_check.sh            (builds the engine-cuda environment on first use)
# Add --write to append the rows to docs/measured-hardware.md (commit them).
# Exits non-zero when the vLLM installed is not the one this check was written against, or when any
# variant failed to run or disagrees with the reference engine (hardware_matrix.py --strict).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PINNED_VLLM="0.33.0"  # requirements/engine-cuda.txt when this check was written
nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader || { echo "no NVIDIA GPU visible" >&2; exit 1; }
grep -qx "vllm==${PINNED_VLLM}" requirements/engine-cuda.txt || {
  echo "requirements/engine-cuda.txt no longer pins vllm==${PINNED_VLLM}: check what this script reads, then update it" >&2; exit 1; }
py="$(python3 pipeline/setup/envs.py engine)"   # engine-cuda.txt on a machine with an NVIDIA GPU
installed="$("$py" -c 'import vllm; print(vllm.__version__)')"
[ "$installed" = "$PINNED_VLLM" ] || { echo "vllm ${installed} installed, this check was written against ${PINNED_VLLM}" >&2; exit 1; }
PYTHONPATH="$PWD" "$py" -c "from pipeline.engines import interface; import json; print(json.dumps(interface.kind('vllm').capabilities(), indent=1, default=str))"
if [ "${1:-}" = "--write" ]; then
  python3 benchmarks/hardware_matrix.py --strict
else
  python3 benchmarks/hardware_matrix.py --no-write --strict
fi
