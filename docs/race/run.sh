#!/usr/bin/env bash
# One run of the 10M-token race (README: the race) as the device runs it: the race's flags, the run's own, --out /tmp/race/NAME.
#   docs/race/run.sh NAME FLAGS...        e.g. docs/race/run.sh dust-adamw --method dust --pop 1024 --optim adamw
# A device call lasts at most 10 minutes, so the run is stopped by SIGINT after LIMIT seconds (default 555), which saves a checkpoint
# and exits with 130, and the same command in the next call, on the machine still warm, resumes it (its seconds go on from the first
# part's, compiling counted in each part); a run that left no checkpoint starts over. After every call the run's config.json,
# metrics.jsonl and log.txt (the GPU's name, what zo printed on stdout: the corpus, the kernels; the last lines of its stderr and its
# exit code) are copied to $OUT/race/NAME (./race/NAME off the device), so nothing measured is lost. The progress bar goes to
# /tmp/race/NAME/stderr.txt (tail -f it to watch).
set -u
name=$1; shift
run=/tmp/race/$name
keep=${OUT:-.}/race/$name
race=(--model small --data stdlib --batch 64 --seq 256 --tokens 10000000 --eval-every 10)
again=(--force); [ -f "$run/model.safetensors" ] && again=(--resume)
mkdir -p "$run" "$keep"
{ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"; } >> "$run/log.txt"
timeout --preserve-status -s INT "${LIMIT:-555}" python3 zo.py "${race[@]}" "$@" --out "$run" "${again[@]}" 2> "$run/stderr.txt" \
  | tee -a "$run/log.txt"
code=${PIPESTATUS[0]}
{ tr '\r' '\n' < "$run/stderr.txt" | grep -v '^ *$' | tail -n 3
  echo "$name: exit $code after ${SECONDS}s, ${again[*]}, last line: $(tail -n 1 "$run/metrics.jsonl" 2>/dev/null)"; } | tee -a "$run/log.txt"
cp "$run/config.json" "$run/metrics.jsonl" "$run/log.txt" "$keep/"
