#!/usr/bin/env bash
# Wheels the lent GPU machine lacks (its image: python 3.12, torch, transformers, numpy; no pydantic,
# no gguf, no pytest, no package index), for cp312 manylinux x86_64, into wheels/ (git-ignored). Resolved with
# their dependencies so pydantic and pydantic-core match, then trimmed to what the image lacks.
# WHEELS_DIR=DIR puts them elsewhere (scripts/train_heads_gpu.py stages them this way).
# Carry them with the work tree: run(..., carry=["wheels"]). About 3 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
pip download -q --only-binary=:all: --python-version "${PYVER:-3.12}" --platform manylinux2014_x86_64 \
  --implementation cp -d "$tmp" pydantic gguf pytest "$@"
out=${WHEELS_DIR:-wheels}
mkdir -p "$out"
for w in "$tmp"/*.whl; do
  case "$(basename "$w")" in
    pydantic-*|pydantic_core-*|annotated_types-*|typing_inspection-*|typing_extensions-*|gguf-*) cp "$w" "$out"/ ;;
    pytest-*|pluggy-*|iniconfig-*|pygments-*) cp "$w" "$out"/ ;;  # gpu_check runs the CUDA test cases
  esac
done
rm -rf "$tmp"
ls "$out" && du -sh "$out"
