#!/usr/bin/env bash
# How the shipped heads, the data curve and the ablation of docs/training.md were made, in order.
# Each step is resumable: rerunning the script skips finished runs (train_report.json present)
# and resumes interrupted ones from their checkpoint.
#   FEATURES=data/feat-train HELDOUT=data/feat-heldout RUNS=runs bash scripts/train_heads.sh
set -euo pipefail
F=${FEATURES:-data/feat-train}
H=${HELDOUT:-data/feat-heldout}
R=${RUNS:-runs}

source "$(dirname "$0")/runs_lib.sh"  # run NAME ARGS...: one training run unless its report exists
mkdir -p "$R"
# the shipped heads first: every training token, one epoch (full EAGLE-3 recipe: fused layers,
# 3 training-time-test steps, soft labels, 8192-token draft vocabulary)
run eagle-full  spec-plugins train eagle  --features "$F" --heldout "$H" --epochs 1
run medusa-full spec-plugins train medusa --features "$F" --heldout "$H" --epochs 1
# the data curve: the same recipe on the first 16k / 48k / 128k training tokens (prefixes of the
# one deterministic extraction; 1 epoch each, so the small runs also take fewer optimizer steps)
for n in 16000 48000 128000; do
  run eagle-$n spec-plugins train eagle --features "$F" --heldout "$H" --max-train-tokens $n --epochs 1
done
# the ablation at 48k tokens, batch 1 (4x the optimizer steps of eagle-48000, so each element's
# effect is not drowned by too few updates): the full recipe, then each element removed once
B1="--max-train-tokens 48000 --epochs 1 --batch-size 1"
run abl-b1-full    spec-plugins train eagle --features "$F" --heldout "$H" $B1
run abl-b1-no-ttt  spec-plugins train eagle --features "$F" --heldout "$H" $B1 --unroll 1
run abl-b1-no-fused spec-plugins train eagle --features "$F" --heldout "$H" $B1 --no-fused
run abl-b1-top1    spec-plugins train eagle --features "$F" --heldout "$H" $B1 --loss top1
# fixed responses vs self-distillation: the target regenerates 200 first turns (ORT, batch 16)
S=${SELF_FEATURES:-data/feat-self}
[ -f "$S/DONE" ] || { t0=$(date +%s)
  spec-plugins train features --responses self --split train --max-tokens 66000 --gen-batch 16 \
    --max-new-tokens 256 --out "$S"
  touch "$S/DONE"  # its own line: a failed `cmd && touch` would not stop the script (set -e skips && lists)
  echo "feat-self: $(( $(date +%s) - t0 )) s" | tee -a "$R/times.txt"; }
run abl-b1-self    spec-plugins train eagle --features "$S" --heldout "$H" $B1
# the next rungs: the full recipe trained longer. Two epochs at batch 1 over the same 0.5M-token
# extraction (8x the optimizer steps of eagle-full), then the extraction extended to 1.5M tokens
# (`train features` with a larger --max-tokens continues after its last shard) and 1.5 epochs at
# batch 1 over all of it. The runs above read all of $F, so they come first on a fresh machine.
run eagle-b1-e2   spec-plugins train eagle --features "$F" --heldout "$H" --epochs 2 --batch-size 1
[ -f "$F/DONE-1.5M" ] || { t0=$(date +%s)
  spec-plugins train features --split train --max-tokens 1500000 --out "$F" --no-progress
  touch "$F/DONE-1.5M"
  echo "feat-train-to-1.5M: $(( $(date +%s) - t0 )) s" | tee -a "$R/times.txt"; }
run eagle-1.5M-b1 spec-plugins train eagle --features "$F" --heldout "$H" --epochs 1.5 --batch-size 1
# then the table, the plot and the in-loop acceptance:
#   python scripts/data_curve.py --runs "$R"
