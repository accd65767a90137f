#!/usr/bin/env bash
# The fine-tuning race (docs/finetune/README.md), as the device runs it, resumable: the same command in the next device call goes
# on where this one stopped.
#   LIMIT=570 docs/finetune/race.sh [METHOD...]     every method of the table below (or those named), each at its three lrs
# For each method: its first steps fill tinygrad's compile cache and time a step (kept out of $OUT; not counted), which sets its
# --eval-every to an evaluation about every EVERY seconds (default 2); then each lr runs alone from the pretrained weights for at
# most BUDGET seconds (default 40; compiling from the cache counted), with --keep-best and --patience PATIENCE (default 10
# evaluations without a new lowest val loss). A run is started only when the call's LIMIT has BUDGET + 20 s left for it; a run
# that ended (its budget, its patience, or a failure) is not run again: on this machine, or on another whose call's results were
# copied into docs/finetune/METHOD-LR. The pretraining first, if it isn't finished on this machine.
set -u
here=$(dirname "$0")
BUDGET=${BUDGET:-40} EVERY=${EVERY:-2} PATIENCE=${PATIENCE:-10} LIMIT=${LIMIT:-555}
declare -A FLAGS=([backprop]="--method backprop --optim adamw" [mezo]="--method mezo --pop 16" [es]="--method es --pop 32"
  [dust]="--method dust --pop 1024 --optim adamw --head exact --direct-scale 1.5 --qkv-scale 4" [hizoo]="--method hizoo --pop 16"
  [lozo]="--method lozo --pop 16" [conmezo]="--method conmezo --pop 16" [zomuon]="--method zomuon --pop 16")
declare -A LRS=([backprop]="3e-4 1e-3 3e-3" [mezo]="1e-5 1e-4 1e-3" [es]="1e-5 1e-4 1e-3" [dust]="3e-4 1e-3 3e-3"
  [hizoo]="1e-5 1e-4 1e-3" [lozo]="1e-5 1e-4 1e-3" [conmezo]="1e-5 1e-4 1e-3" [zomuon]="1e-3 1e-2 1e-1")
methods=("$@"); [ $# -gt 0 ] || methods=(backprop mezo es dust hizoo lozo conmezo zomuon)
for m in "${methods[@]}"; do [ -n "${FLAGS[$m]:-}" ] || { echo "race.sh: no method $m (${!FLAGS[*]})"; exit 2; }; done
[ -f /tmp/finetune/pretrain/done ] || LIMIT=$LIMIT "$here/run.sh" pretrain || exit
for m in "${methods[@]}"; do
  read -ra lrs <<< "${LRS[$m]}"; read -ra flags <<< "${FLAGS[$m]}"
  todo=()  # the lrs whose runs have not ended, here or in a call whose results are in docs/finetune
  for lr in "${lrs[@]}"; do [ -f "/tmp/finetune/$m-$lr/ended" ] || [ -f "$here/$m-$lr/metrics.jsonl" ] || todo+=("$lr"); done
  [ ${#todo[@]} -gt 0 ] || continue  # no warm-up for a method whose runs have all ended
  warm=/tmp/finetune/compile-$m
  # six steps, evaluated at the first and the last: steps 1-4 time a step
  [ -f "$warm/done" ] || OUT=/tmp/compiled LIMIT=$(( LIMIT - SECONDS )) "$here/run.sh" "compile-$m" "${flags[@]}" --lr "${lrs[0]}" \
    --steps 6 --eval-every 5 | tail -n 1
  every=$(python3 - "$warm/metrics.jsonl" "$EVERY" <<'PY'
import json, sys
with open(sys.argv[1]) as f: s = [json.loads(line)["seconds"] for line in f]
if len(s) < 6: sys.exit(f"{sys.argv[1]}: the six steps did not finish")
print(max(1, round(float(sys.argv[2]) / ((s[4] - s[1]) / 3))))
PY
) || exit
  for lr in "${todo[@]}"; do
    run=/tmp/finetune/$m-$lr
    rm -rf "$run"  # a run a lost call cut short starts over: its budget is one part's
    left=$(( LIMIT - SECONDS ))
    [ "$left" -ge $(( BUDGET + 20 )) ] || { echo "race.sh: $left s of LIMIT left, too few for a run of $BUDGET s: run again"; exit 1; }
    LIMIT=$BUDGET "$here/run.sh" "$m-$lr" "${flags[@]}" --lr "$lr" --steps 1000000 --eval-every "$every" --patience "$PATIENCE" \
      --keep-best | tail -n 1  # its exit, steps and last line
    touch "$run/ended"  # its budget (exit 130), its patience (0) or a failure (2): the run is what it is
  done
done
echo "race.sh: every run has ended"
