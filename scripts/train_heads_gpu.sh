#!/usr/bin/env bash
# Train the EAGLE-3-style drafter (then Medusa heads, with the time left) on a lent GPU, within its
# limits (../shared/gpu/README.md): 15 minutes of device time in all, 64 MiB per call (work tree +
# carried paths), no package index there, the machine given back 30 s after a call.
#
# 1. Here (CPU, ~5 min, once):
#      bash scripts/train_heads_gpu.sh stage          # -> gpu-stage/call1..N, gpu-stage/CALLS.md
#    tokenises the ShareGPT train split (the [train] extra; 4096 tokens per conversation at most,
#    about 21M tokens) and 40k held-out tokens with SmolLM2's tokenizer and chat template, bundles
#    them (uint16 shards + packed answer masks) with the SmolLM2 GGUF (94 MiB) and the wheels the
#    image lacks (pydantic & co., gguf) into one tar.xz, and splits it into parts that fit a call
#    beside the work tree (16 MiB): N = 3 today. CALLS.md lists the calls with their sizes.
# 2. On the device, back to back (each call within 30 s of the last one's end):
#      run(command="bash scripts/train_heads_gpu.sh receive 1", carry=["gpu-stage/call1"], timeout_s=120)
#      run(command="bash scripts/train_heads_gpu.sh receive 2", carry=["gpu-stage/call2"], timeout_s=120)
#      run(command="bash scripts/train_heads_gpu.sh train 3",   carry=["gpu-stage/call3"], timeout_s=540)
#      give_back()
#    receive K keeps part K in $HOME/spec-gpu-stage (checked with sha256); train N receives the last
#    part, joins and checks the bundle, installs the wheels and the project, and runs one process:
#    SmolLM2 in bf16 on CUDA, its fused features (layers 3/15/28) computed 1M tokens at a time in
#    64k-position prefills, the EAGLE head trained on them by the project's trainer, then Medusa.
#    It stops by BUDGET_S (default 480 s after the call starts) and writes the heads from their
#    last weights; snapshots every 60 s mean a call cut off by its timeout still returns a head.
#    Optimizer checkpoints stay in $HOME/spec-gpu-stage/work/KEY (KEY: the bundle and the options
#    after `train K`): the same call again on the warm machine resumes them; other options get
#    their own folder (the log names it).
# 3. The heads come back in the last call's files: eagle/ and medusa/ (head.safetensors fp16,
#    config.json, train_report.json), run.json (tokens seen, time per step and per phase), log.txt.
#    Copy eagle/ to runs/gpu-eagle and measure it here: python scripts/data_curve.py --only gpu-eagle --merge
#
# The parallel drafter on the target's own answers (issue 47): the same stage and receive calls, then
#      run(command="BUDGET_S=520 bash scripts/train_heads_gpu.sh train 3 --heads parallel,eagle --no-medusa \
#                   --distill-s 200 --gen-rows 256 --block-size 8", carry=["gpu-stage/call3"], timeout_s=580)
#    answers every turn of the staged conversations greedily and at temperatures 0.7 and 1.0 for 200 s
#    (batched 256 rows on the static cache, CUDA graphs), computes the features over those answers and
#    trains the parallel drafter, then the EAGLE head on the same data (the data curve's equal-data rung).
#    run.json's self_distill says the tokens made and the seconds per million tokens.
#
# CPU smoke run of the same steps at toy scale (a tiny random model, a few thousand tokens; CI runs
# it in tests/test_train_gpu_script.py):  bash scripts/train_heads_gpu.sh smoke DIR
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || PY=python
STAGE=${STAGE:-gpu-stage}                        # what `stage` wrote (carried, one callK per call)
STAGE_HOME=${STAGE_HOME:-$HOME/spec-gpu-stage}   # on the device: outside the work tree, kept while warm
DRIVER=scripts/train_heads_gpu.py

receive() { "$PY" $DRIVER receive --part "$STAGE/call$1" --into "$STAGE_HOME"; }

install() {  # the image has torch and transformers; pydantic, gguf and the project come from the bundle
  if ! "$PY" -c "import pydantic, gguf, spec_plugins.backends, spec_plugins.training.device_run" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$STAGE_HOME/site" "$STAGE_HOME"/bundle/wheels/*.whl
    export PYTHONPATH="$STAGE_HOME/site${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || { echo "cannot install the project"; exit 1; }
  fi
}

work_dir() {  # work_dir [device-step options]: this call's optimizer checkpoints, keyed on the bundle and options
  # A repeated identical call resumes from its own checkpoints (a series cut off by a call's limit
  # goes on in the next); a call with other options or another bundle gets its own folder, so a
  # checkpoint made with other settings never meets it. BUDGET_S is not part of the key.
  local key
  key=$({ cat "$STAGE_HOME/bundle/manifest.json"; printf '%s\0' "$@"; } | sha256sum | cut -c1-16)
  echo "$STAGE_HOME/work/$key"
}

train() {  # train K [device-step options]: the last call
  local start work k=$1; shift
  start=$(date +%s)
  : "${OUT:?OUT (the folder whose files come back) is not set}"
  mkdir -p "$OUT"
  at() { echo "[train_heads_gpu: $(($(date +%s) - start)) s] $*"; }  # the setup's phases, timed in the log
  {
    receive "$k"
    "$PY" $DRIVER unpack --parts "$STAGE_HOME" --dest "$STAGE_HOME/bundle"
    at "received and unpacked"
    install
    at "installed"
    work=$(work_dir "$@")
    if [ -d "$work" ]; then at "work folder $work: resuming this call's checkpoints (same bundle and options)"
    else at "work folder $work: new (this bundle and these options)"; fi
    for other in "$STAGE_HOME"/work/*/; do  # made by other options: kept, not used
      [ "${other%/}" = "$work" ] || [ ! -f "$other/options.txt" ] || at "NOTE: left as it is, other options: ${other%/} ($(cat "$other/options.txt"))"
    done
    mkdir -p "$work"
    printf '%s ' "$@" > "$work/options.txt"
    "$PY" $DRIVER device --bundle "$STAGE_HOME/bundle" --out "$OUT" --work "$work" \
      --until $((start + ${BUDGET_S:-480})) "$@"
    at "done"
  } 2>&1 | tee "$OUT/log.txt"
}

case "${1:-}" in
  stage) shift; "$PY" $DRIVER stage --out "$STAGE" "$@" ;;
  receive) receive "${2:?receive K: the part number}" ;;
  train) shift; train "${1:?train K: the last part number}" "${@:2}" ;;
  smoke)  # stage, receive and train at toy scale on the CPU, in DIR (default: a new temporary folder)
    dir=${2:-$(mktemp -d)}
    STAGE=$dir/stage STAGE_HOME=$dir/home OUT=$dir/out
    export STAGE STAGE_HOME OUT
    "$PY" $DRIVER stage --out "$STAGE" --smoke --max-tokens 3000 --max-seq 256 --heldout-tokens 600 \
      --heldout-max-seq 128 --shard-tokens 1000 --parts 3 --xz-preset 1
    n=$(ls -d "$STAGE"/call* | wc -l)
    for k in $(seq 1 $((n - 1))); do receive "$k"; done
    train "$n" --device cpu --dtype float32 --batch-size 2 --window 64 --draft-vocab 512 --max-steps 12 \
      --medusa-batch 2 --prefill-tokens 2048 --snapshot-steps 4 --save-every 5 --reserve-s 0 --medusa-min-s 0
    ;;
  *) sed -n '2,40p' "$0"; exit 2 ;;
esac
