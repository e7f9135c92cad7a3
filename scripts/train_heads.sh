#!/usr/bin/env bash
# How the shipped heads, the data curve and the ablation of docs/training.md were made, in order.
# Each step is resumable: rerunning the script skips finished runs (train_report.json present)
# and resumes interrupted ones from their checkpoint.
#   FEATURES=data/feat-train HELDOUT=data/feat-heldout RUNS=runs bash scripts/train_heads.sh
set -euo pipefail
F=${FEATURES:-data/feat-train}
H=${HELDOUT:-data/feat-heldout}
R=${RUNS:-runs}
SELF=${SELF_FEATURES:-data/feat-self}

run() {  # run NAME ARGS...: one training run unless its report exists
  local name=$1; shift
  if [ -f "$R/$name/train_report.json" ]; then echo "skip $name"; return; fi
  local t0=$(date +%s)
  "$@" --out "$R/$name" --no-progress > "$R/$name.log" 2>&1
  echo "$name: $(( $(date +%s) - t0 )) s" | tee -a "$R/times.txt"
}
mkdir -p "$R"
# the shipped heads first: every training token, one epoch (full EAGLE-3 recipe: fused layers,
# 3 training-time-test steps, soft labels, 8192-token draft vocabulary)
run eagle-full  spec-plugins train eagle  --features "$F" --heldout "$H" --epochs 1
run medusa-full spec-plugins train medusa --features "$F" --heldout "$H" --epochs 1
# ablation and the start of the data curve at 32k tokens, one epoch each (the full recipe, then
# each element removed once, then self-distilled targets instead of the fixed responses)
run eagle-32k    spec-plugins train eagle --features "$F" --heldout "$H" --max-train-tokens 32000 --epochs 1
run abl-no-ttt   spec-plugins train eagle --features "$F" --heldout "$H" --max-train-tokens 32000 --epochs 1 --unroll 1
run abl-no-fused spec-plugins train eagle --features "$F" --heldout "$H" --max-train-tokens 32000 --epochs 1 --no-fused
run abl-top1     spec-plugins train eagle --features "$F" --heldout "$H" --max-train-tokens 32000 --epochs 1 --loss top1
if [ -d "$SELF" ]; then
  run eagle-self-32k spec-plugins train eagle --features "$SELF" --heldout "$H" --max-train-tokens 32000 --epochs 1
fi
run eagle-100k spec-plugins train eagle --features "$F" --heldout "$H" --max-train-tokens 100000 --epochs 1
