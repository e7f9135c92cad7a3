# Sourced by the training-run scripts (train_heads.sh, parallel_runs.sh): run NAME ARGS... trains
# one run into $R/NAME unless its report exists (a finished run is skipped, an interrupted one
# resumes from its checkpoint), logs to $R/NAME.log and appends its wall time to $R/times.txt.
run() {
  local name=$1; shift
  if [ -f "$R/$name/train_report.json" ]; then echo "skip $name"; return; fi
  local t0=$(date +%s)
  "$@" --out "$R/$name" --no-progress > "$R/$name.log" 2>&1
  echo "$name: $(( $(date +%s) - t0 )) s" | tee -a "$R/times.txt"
}
