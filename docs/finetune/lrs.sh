#!/usr/bin/env bash
# One method of the fine-tuning race at its best of three lrs (docs/finetune/README.md), as the device runs it:
#   docs/finetune/lrs.sh NAME SECONDS PROBE "LR1 LR2 LR3" FLAGS...   e.g. lrs.sh mezo 300 60 "1e-4 3e-4 1e-3" --method mezo --pop 16
# Twelve steps of the method come first, kept out of $OUT: they fill tinygrad's compile cache, so that no probe compiles for
# the others, and they time a step, which sets the runs' --steps to what fits SECONDS. Then each lr runs alone for PROBE
# seconds (run.sh NAME-LR, stopped with a checkpoint), and the lr of lowest val loss at the last step that every lr evaluated
# goes on, resumed, to its last step. The lr is constant until the warmdown, so the probes are the first steps of the runs
# they would be. A probe that failed (a non-finite loss: zo exits 2) loses. Run again after a stop, it goes on from where it
# was: a probe that ended is not run again. All within LIMIT (default 555) of this script's start; the pretraining first, if
# it isn't finished.
set -u
name=$1 budget=$2 probe=$3; read -ra lrs <<< "$4"; shift 4
here=$(dirname "$0") warm=/tmp/finetune/compile-$name
[ "$probe" -gt 30 ] || { echo "lrs.sh: PROBE $probe: docs/device_run.sh starts a run with more than 30 s only"; exit 2; }
[ -f /tmp/finetune/pretrain/done ] || "$here/run.sh" pretrain || exit
[ -f "$warm/done" ] || OUT=/tmp/compiled LIMIT=$(( ${LIMIT:-555} - SECONDS )) "$here/run.sh" "compile-$name" "$@" \
  --lr "${lrs[0]}" --steps 12 --eval-every 12 | tail -n 1
# steps 2..10 are clean (step 1's seconds hold step 0's evaluation); a run's two parts each have a first step
steps=$(python3 - "$warm/metrics.jsonl" "$budget" <<'EOF'
import json, sys
with open(sys.argv[1]) as f: s = [json.loads(line)["seconds"] for line in f]
if len(s) < 12: sys.exit(f"{sys.argv[1]}: the twelve steps did not finish")
print(max(1, int((float(sys.argv[2]) - 2 * s[0]) / ((s[10] - s[2]) / 8))))
EOF
) || exit
echo "$name: $steps steps fit $budget s"
for lr in "${lrs[@]}"; do
  grep -qs ': exit [0-9]* after' "/tmp/finetune/$name-$lr/log.txt" && continue  # this probe ended
  left=$(( ${LIMIT:-555} - SECONDS ))
  [ "$left" -ge "$probe" ] || { echo "$name: $left s of LIMIT left, too few for a $probe s probe: run again"; exit 1; }
  LIMIT=$probe "$here/run.sh" "$name-$lr" "$@" --lr "$lr" --steps "$steps" | tail -n 1  # its exit, steps and last line
done
best=$(python3 - "$name" "${lrs[@]}" <<'EOF'
import os, sys
from plot import compared, metrics  # plot.py --best's comparison, from this (the repository's) folder
name, *lrs = sys.argv[1:]
runs = {f"/tmp/finetune/{name}-{lr}": lr for lr in lrs}
# a probe stopped before its first evaluation loses, and compared leaves out a failed one (zo exits 2 on a non-finite loss)
rs = [(run, None, e) for run in runs if os.path.exists(f"{run}/metrics.jsonl") and (e := metrics(run))]
common, val = compared(rs)
if not val: sys.exit(f"{name}: no lr's probe ended well (see /tmp/finetune/{name}-*/log.txt)")
print(f"{name}: at step {common}:", ", ".join(f"lr {runs[run]} val {v:.4f}" for run, v in val.items()),
      "(step 0: PROBE is too short to tell)" if common == 0 else "", file=sys.stderr)
print(runs[min(val, key=val.get)])
EOF
) || exit
[ -f "/tmp/finetune/$name-$best/done" ] && { echo "$name: lr $best finished"; exit 0; }
echo "$name: lr $best goes on"
LIMIT=$(( ${LIMIT:-555} - SECONDS )) exec "$here/run.sh" "$name-$best" "$@" --lr "$best" --steps "$steps"
