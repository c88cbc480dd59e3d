#!/usr/bin/env bash
# Start a job on the device machine detached (it outlives the 600 s call), its output in ~/res/JOB.log, then wait
# as wait.sh does: bash benchmarks/device/start.sh JOB SECONDS [ARGS...]; JOB is a script of this folder
# (first, gap, rungs, many, tf32, upstream, e2e, serve, ...).
set -uo pipefail
job=$1 wait_s=$2
shift 2
# The machine's copy of the tree may hold a stale .git: .commit (written here before the call) names the commit.
BENCH_COMMIT=$(cat .commit 2>/dev/null || git rev-parse --short HEAD)
export BENCH_COMMIT
( setsid nohup bash "$(dirname "$0")/$job.sh" "$@" > ~/res/"$job".log 2>&1 & )
exec bash "$(dirname "$0")/wait.sh" "$wait_s" "$job"
