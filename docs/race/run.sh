#!/usr/bin/env bash
# One run of the 10M-token race (README: the race) as the device runs it: the race's flags, the run's own, --out /tmp/race/NAME.
#   docs/race/run.sh NAME FLAGS...        e.g. docs/race/run.sh dust-adamw --method dust --pop 1024 --optim adamw
# A device call lasts at most 10 minutes, so the run is stopped by SIGINT after LIMIT seconds (default 555), which saves a checkpoint,
# and the same command in the next call, on the machine still warm, resumes it (its seconds go on from the first part's, compiling
# counted in each part). After every call the run's config.json, metrics.jsonl and log.txt (the GPU's name and what zo printed: the
# corpus, the kernels, each part's exit) are copied to $OUT/race/NAME (./race/NAME off the device), so nothing measured is lost.
set -u
name=$1; shift
run=/tmp/race/$name
keep=${OUT:-.}/race/$name
race=(--model small --data stdlib --batch 64 --seq 256 --tokens 10000000 --eval-every 10)
resume=(); [ -f "$run/model.safetensors" ] && resume=(--resume)
mkdir -p "$run" "$keep"
{ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"; } >> "$run/log.txt"
timeout -s INT "${LIMIT:-555}" python3 zo.py "${race[@]}" "$@" --out "$run" "${resume[@]}" | tee -a "$run/log.txt"
echo "$name: exit ${PIPESTATUS[0]} after ${SECONDS}s, ${resume[*]:-fresh}, last line: $(tail -n 1 "$run/metrics.jsonl" 2>/dev/null)" \
  | tee -a "$run/log.txt"
cp "$run/config.json" "$run/metrics.jsonl" "$run/log.txt" "$keep/"
