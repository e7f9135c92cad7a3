#!/usr/bin/env bash
# GPU acceptance check (scripts/gpu_check.py): every proposer exact against transformers' own greedy
# generate(), fp32 and bf16, one row and a batch with holes, host syncs per round, speed at
# SmolLM2's shape, the CUDA test cases. Under 8 minutes, a table last. Without a GPU it says so
# and exits 0; `--cpu` runs the same checks on the CPU (CI runs that). Each finished row goes to
# $OUT/gpu_check.jsonl at once (where $OUT is set); at 470 s SIGINT ends the run, which still prints
# the table (a process that ignores it is killed 20 s later).
#
# On the lent GPU machine (no package index there): stage the wheels here once with
#   bash scripts/gpu_wheels.sh            # -> wheels/ (git-ignored, about 3 MB)
# and run, carrying them:  run(command="bash scripts/gpu_check.sh", carry=["wheels"])
# Installed packages are used as they are; missing ones come from wheels/ when it is there.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || PY=python
if ! "$PY" -c "import pydantic, pytest, spec_plugins.backends" 2>/dev/null; then
  if [ -d wheels ]; then "$PY" -m pip install -q --no-index --no-deps wheels/*.whl; fi
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . || { echo "gpu_check: cannot install the project"; exit 1; }
fi
exec timeout --signal=INT --kill-after=20 470 "$PY" scripts/gpu_check.py "$@"
