#!/usr/bin/env bash
# GPU check: the GPU test matrix (PyTorch CUDA, ONNX Runtime CUDA EP, TensorRT) and a small bench,
# under 8 minutes, a short table last. Installs nothing. Without a GPU it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec timeout --signal=INT 470 python scripts/gpu_check.py "$@"
