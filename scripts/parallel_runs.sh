#!/usr/bin/env bash
# The parallel drafter's CPU rungs of docs/training.md, in order, beside the EAGLE rungs of
# scripts/train_heads.sh (same features: the first tokens of one deterministic ShareGPT
# extraction, so a --max-train-tokens rung is the same data as the EAGLE rung of that size).
# Each step is resumable: a finished run (train_report.json) is skipped, an interrupted one resumes.
#   FEATURES=data/feat-train HELDOUT=data/feat-heldout RUNS=runs bash scripts/parallel_runs.sh
# then: python scripts/parallel_curve.py --runs runs --names <the runs below>,shipped-eagle
set -euo pipefail
F=${FEATURES:-data/feat-train}
H=${HELDOUT:-data/feat-heldout}
R=${RUNS:-runs}
SHIPPED=examples/heads/smollm2-135m-instruct/eagle
P="--block-size 6 --anchors 64"

source "$(dirname "$0")/runs_lib.sh"  # run NAME ARGS...: one training run unless its report exists
mkdir -p "$R"
# equal data with the EAGLE rungs abl-b1-full (the first 48k tokens, batch 1, 1 epoch) and eagle-b1-e2
# (the first 0.5M tokens, batch 1, 2 epochs); -masks: the block queries read learned inputs only
for a in "" "-masks"; do
  A=$([ -z "$a" ] && echo --anchor-input || echo --no-anchor-input)
  run parallel-b1-48k$a spec-plugins train parallel --features "$F" --heldout "$H" $P $A --max-train-tokens 48000 \
    --batch-size 1
  run parallel-b1-e2$a spec-plugins train parallel --features "$F" --heldout "$H" $P $A --max-train-tokens 500000 \
    --batch-size 1 --epochs 2
  # from the shipped EAGLE head (19.4M ShareGPT positions on a GPU): its layer and vocabulary, then
  # one epoch over the first 0.5M tokens
  run parallel-from-eagle$a spec-plugins train parallel --features "$F" --heldout "$H" $P $A \
    --max-train-tokens 500000 --batch-size 1 --init "$SHIPPED"
done
run parallel-from-eagle-lr3e-4 spec-plugins train parallel --features "$F" --heldout "$H" $P --max-train-tokens 500000 \
  --batch-size 1 --init "$SHIPPED" --lr 3e-4
# deeper block drafters, same recipe as parallel-from-eagle-lr3e-4: 2 and 4 decoder layers over
# each block (fresh, starting as the identity) after the EAGLE layer
for L in 2 4; do
  run parallel-deep$L-from-eagle spec-plugins train parallel --features "$F" --heldout "$H" $P \
    --max-train-tokens 500000 --batch-size 1 --init "$SHIPPED" --lr 3e-4 --block-layers $L
done
# the same 2 block layers seeing the context (each caches the committed pairs, as DFlash's layers do)
run parallel-ctx2-from-eagle spec-plugins train parallel --features "$F" --heldout "$H" $P \
  --max-train-tokens 500000 --batch-size 1 --init "$SHIPPED" --lr 3e-4 --block-layers 2 --block-context
# self-distilled vs ShareGPT answers at equal size: the target answers every turn of the same
# conversations (greedy, and sampled at 0.7 and 1.0), then the same start from the EAGLE head
N=${SELF_TOKENS:-20000}
S=${SELF_TOKENS_DIR:-data/tok-self}
[ -f "$S/meta.json" ] || spec-plugins train self-distill --out "$S" --max-tokens "$N" --temperatures 0,0.7,1.0 \
  --max-new-tokens 256 --rows 12 --backend onnxruntime | tee "$R/self-distill.json"
[ -f "$S-feat/progress.json" ] && grep -q '"exhausted": true' "$S-feat/progress.json" || \
  spec-plugins train features --source tokens --tokens "$S" --max-tokens "$N" --out "$S-feat" --no-progress
run parallel-from-eagle-self spec-plugins train parallel --features "$S-feat" --heldout "$H" $P --batch-size 1 \
  --init "$SHIPPED" --lr 3e-4
run parallel-from-eagle-sharegpt spec-plugins train parallel --features "$F" --heldout "$H" $P --batch-size 1 \
  --max-train-tokens "$N" --init "$SHIPPED" --lr 3e-4
# the few-million-token rung: the extraction extended to 2M tokens (`train features` with a larger
# --max-tokens continues after its last shard), then the parallel drafter against the EAGLE head at
# equal data from scratch (batch 1, 1 epoch), and the shipped recipe (from the EAGLE head) on 4x its data
[ -f "$F/DONE-2M" ] || { t0=$(date +%s)
  spec-plugins train features --split train --max-tokens 2000000 --out "$F" --no-progress
  touch "$F/DONE-2M"  # its own line: a failed `cmd && touch` would not stop the script (set -e skips && lists)
  echo "feat-train-to-2M: $(( $(date +%s) - t0 )) s" | tee -a "$R/times.txt"; }
M="--max-train-tokens 2000000 --batch-size 1"
run parallel-2M-from-eagle spec-plugins train parallel --features "$F" --heldout "$H" $P $M --init "$SHIPPED" --lr 3e-4
run parallel-2M-b1 spec-plugins train parallel --features "$F" --heldout "$H" $P $M
run eagle-2M-b1 spec-plugins train eagle --features "$F" --heldout "$H" $M --epochs 1
