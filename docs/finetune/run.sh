#!/usr/bin/env bash
# One run of the fine-tuning race (docs/finetune/README.md) as the device runs it.
#   docs/finetune/run.sh pretrain             the small GPT by backprop-AdamW on 10M tokens of the stdlib (the 10M race's best run)
#   docs/finetune/run.sh NAME FLAGS...        fine-tune it on tinyshakespeare: the race's flags, then the run's own, e.g.
#                                             docs/finetune/run.sh mezo-0.001 --method mezo --pop 16 --lr 0.001 --steps 2000
# Runs live in /tmp/finetune/NAME; a fine-tuning run first makes or finishes the pretraining, if /tmp/finetune/pretrain/done
# isn't there, within its LIMIT. A run is stopped by SIGINT after LIMIT seconds (default 555) of the call, which saves a
# checkpoint, and the same command on the machine still warm resumes it (docs/race/run.sh does the same). After each call the run's config.json, metrics.jsonl and log.txt (the
# GPU, what zo printed, the last lines of its stderr, its exit code) are copied to $OUT/finetune/NAME.
# DATA names the text (default .data/tinyshakespeare.txt: Karpathy's char-rnn tinyshakespeare, in the git-ignored .data/,
# which the device call carries).
set -u
name=$1; shift
run=/tmp/finetune/$name
keep=${OUT:-.}/finetune/$name
if [ "$name" = pretrain ]; then
  flags=(--model small --data stdlib --batch 64 --seq 256 --tokens 10000000 --eval-every 10
         --method backprop --optim adamw --lr 0.004 --warmdown 0.3)
else
  [ -f /tmp/finetune/pretrain/done ] || LIMIT=${LIMIT:-555} "$0" pretrain || exit
  flags=(--model small --data "${DATA:-.data/tinyshakespeare.txt}" --batch 64 --seq 256 --init /tmp/finetune/pretrain
         --warmdown 0.3)
fi
again=(--force); [ -f "$run/model.safetensors" ] && again=(--resume)
mkdir -p "$run" "$keep"
{ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"; } >> "$run/log.txt"
left=$(( ${LIMIT:-555} - SECONDS ))
[ "$left" -gt 30 ] || { echo "$name: $left s of LIMIT left, too few to start"; exit 1; }
timeout --preserve-status -s INT "$left" python3 zo.py "${flags[@]}" "$@" --out "$run" "${again[@]}" \
  2> "$run/stderr.txt" | tee -a "$run/log.txt"
code=${PIPESTATUS[0]}
{ tr '\r' '\n' < "$run/stderr.txt" | grep -v '^ *$' | tail -n 3
  echo "$name: exit $code after ${SECONDS}s, ${again[*]}, last line: $(tail -n 1 "$run/metrics.jsonl" 2>/dev/null)"; } \
  | tee -a "$run/log.txt"
cp "$run/config.json" "$run/metrics.jsonl" "$run/log.txt" "$keep/"
[ "$name" = pretrain ] && [ "$code" = 0 ] && touch "$run/done"  # finished: fine-tuning may start from it
exit "$code"
