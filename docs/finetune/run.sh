#!/usr/bin/env bash
# One run of the fine-tuning race (docs/finetune/README.md) as the device runs it.
#   docs/finetune/run.sh pretrain             the small GPT by backprop-AdamW on 10M tokens of the stdlib (the 10M race's best run)
#   docs/finetune/run.sh NAME FLAGS...        fine-tune it on tinyshakespeare at a constant lr: the race's flags, then the
#                                             run's own, e.g. docs/finetune/run.sh mezo-0.001 --method mezo --pop 16 --lr 0.001
# Runs live in /tmp/finetune/NAME; a fine-tuning run first makes or finishes the pretraining, if /tmp/finetune/pretrain/done
# isn't there, within its LIMIT. LIMIT, the stop and the resume, and what is copied to $OUT/finetune/NAME: docs/device_run.sh.
# DATA names the text (default .data/tinyshakespeare.txt: Karpathy's char-rnn tinyshakespeare, in the git-ignored .data/,
# which the device call carries). SIZE, the model and a step's tokens (default the race's: --model small --batch 64 --seq 256), and
# PRETRAIN, the pretraining's tokens (default 10000000), let a CPU check run the same scripts at a tiny size.
set -u
name=$1; shift
here=$(dirname "$0") size=${SIZE:---model small --batch 64 --seq 256}
if [ "$name" = pretrain ]; then
  exec "$here/../device_run.sh" finetune pretrain $size --data stdlib --tokens "${PRETRAIN:-10000000}" \
    --eval-every 10 --method backprop --optim adamw --lr 0.004 --warmdown 0.3
fi
[ -f /tmp/finetune/pretrain/done ] || "$0" pretrain || exit
LIMIT=$(( ${LIMIT:-555} - SECONDS )) exec "$here/../device_run.sh" finetune "$name" $size \
  --data "${DATA:-.data/tinyshakespeare.txt}" --init /tmp/finetune/pretrain --warmdown 0 "$@"
