#!/usr/bin/env bash
# One zo run as the device runs it, for the races (docs/race/run.sh, docs/finetune/run.sh):
#   docs/device_run.sh GROUP NAME FLAGS...     python3 zo.py FLAGS --out /tmp/GROUP/NAME
# A device call lasts at most 10 minutes, so the run is stopped by SIGINT after LIMIT seconds (default 555), which saves a
# checkpoint and exits with 130, and the same command in the next call, on the machine still warm, resumes it (its seconds go
# on from the first part's, compiling counted in each part); a run that left no checkpoint starts over. After every call the
# run's config.json, metrics.jsonl and log.txt (the GPU's name, what zo printed on stdout: the corpus, the kernels; the last lines
# of its stderr and its exit code) are copied to $OUT/GROUP/NAME (./GROUP/NAME off the device), so nothing measured is lost, and a
# finished run is marked by /tmp/GROUP/NAME/done. The progress bar goes to /tmp/GROUP/NAME/stderr.txt (tail -f it to watch).
# timeout --foreground signals zo alone: without it, timeout signals zo and then its own process group, zo among it, and a
# second SIGINT that arrives after zo has handled the first quits at once instead of finishing the step (every run of the
# fine-tuning race of 2026-12-07 logged two SIGINTs and quit: this is the likely cause, not yet seen gone on the GPU).
set -u
group=$1 name=$2; shift 2
run=/tmp/$group/$name
keep=${OUT:-.}/$group/$name
again=(--force); [ -f "$run/model.safetensors" ] && again=(--resume)
mkdir -p "$run" "$keep"
{ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"; } >> "$run/log.txt"
left=$(( ${LIMIT:-555} - SECONDS ))
[ "$left" -gt 30 ] || { echo "$name: $left s of LIMIT left, too few to start"; exit 1; }
timeout --preserve-status --foreground -s INT "$left" python3 zo.py "$@" --out "$run" "${again[@]}" 2> "$run/stderr.txt" \
  | tee -a "$run/log.txt"
code=${PIPESTATUS[0]}
{ tr '\r' '\n' < "$run/stderr.txt" | grep -v '^ *$' | tail -n 3
  echo "$name: exit $code after ${SECONDS}s, ${again[*]}, last line: $(tail -n 1 "$run/metrics.jsonl" 2>/dev/null)"; } \
  | tee -a "$run/log.txt"
cp "$run/config.json" "$run/metrics.jsonl" "$run/log.txt" "$keep/"
[ "$code" = 0 ] && touch "$run/done"
exit "$code"
