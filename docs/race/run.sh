#!/usr/bin/env bash
# One run of the 10M-token race (README: the race) as the device runs it: the race's flags, the run's own, --out /tmp/race/NAME.
#   docs/race/run.sh NAME FLAGS...        e.g. docs/race/run.sh dust-adamw --method dust --pop 1024 --optim adamw
# LIMIT, the stop and the resume, and what is copied to $OUT/race/NAME: docs/device_run.sh.
set -u
name=$1; shift
race=(--model small --data stdlib --batch 64 --seq 256 --tokens 10000000 --eval-every 10)
exec "$(dirname "$0")/../device_run.sh" race "$name" "${race[@]}" "$@"
