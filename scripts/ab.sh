#!/usr/bin/env bash
# Before/after in one run: the same command under two commits' code, alternately (A B A B ...),
# so a change's effect is measured side by side on one machine state, not against a remembered
# number. Each commit is exported once (git archive) into a directory importable as the package;
# the installed dependencies are shared.
#
#   bash scripts/ab.sh BEFORE AFTER ROUNDS OUTDIR -- python -m spec_plugins.cli bench ... --out {out}
#
# {out} in the command becomes OUTDIR/<label>-<round> (label: before|after); stdout/stderr go to
# OUTDIR/<label>-<round>.log. Nothing of the working tree is used, so commit what you measure.
set -euo pipefail
[ $# -ge 6 ] && [ "$5" = "--" ] || { echo "usage: $0 BEFORE AFTER ROUNDS OUTDIR -- COMMAND..." >&2; exit 2; }
before=$1 after=$2 rounds=$3 outdir=$4
shift 5
root=$(git rev-parse --show-toplevel)
mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd)
unpack() {  # unpack REF DIR: the commit's tree, laid out so that PYTHONPATH=DIR imports it
  local ref=$1 dir=$2
  rm -rf "$dir" && mkdir -p "$dir"
  git -C "$root" archive "$ref" | tar -x -C "$dir"
  mv "$dir/backends" "$dir/spec_plugins/backends"
  mv "$dir/exporters" "$dir/spec_plugins/exporters"
}
work=$(mktemp -d)
unpack "$before" "$work/before"
unpack "$after" "$work/after"
echo "before = $(git -C "$root" rev-parse --short "$before"), after = $(git -C "$root" rev-parse --short "$after")" \
  | tee "$outdir/refs.txt"
for r in $(seq 1 "$rounds"); do
  for label in before after; do
    out="$outdir/$label-$r"
    cmd=("${@//\{out\}/$out}")
    echo "[$(date +%T)] $label round $r: ${cmd[*]}"
    # run from the exported tree (relative paths in the command resolve against it: configs, prompts)
    (cd "$work/$label" && PYTHONPATH="$work/$label" HF_HUB_OFFLINE=1 "${cmd[@]}") > "$out.log" 2>&1 \
      || { echo "  failed: see $out.log"; tail -5 "$out.log"; }
  done
done
rm -rf "$work"
