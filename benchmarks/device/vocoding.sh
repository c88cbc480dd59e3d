#!/usr/bin/env bash
# Where the vocoding thread's S3Gen work runs, compared on one machine (issue 24: `serve --vocoding`): the real
# server (probe_worker --paths serve: 250-token requests, bf16 CFM, --vocode-batch 32) once per placement, in
# this order: thread first (it fills the kernel cache the others then find), interleaved, process, interleaved
# with 2 T3 steps a part; then 32 streams alone for the first three; then T3 alone (bench_batch, 64 and
# 256 rows).
# Raw lines in ~/res/vocoding_*.jsonl, the tables in ~/res/vocoding.log. Run through start.sh:
#   bash benchmarks/device/start.sh vocoding 560    (and, if it runs on, bash benchmarks/device/wait.sh 560 vocoding)
# Arguments name the parts to run (thread interleaved process interleaved2 thread32 interleaved32 process32
# batch); none runs all of them.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
echo "== commit $BENCH_COMMIT"
bash "$(dirname "$0")/model.sh" english
dir=/tmp/serve-english
only=" $* "
wanted() { [ "$only" = "  " ] || [[ $only == *" $1 "* ]]; }
probe() {  # NAME SCENARIO-FLAGS PLACEMENT-FLAGS...
  local name=$1 load=$2
  shift 2
  wanted "$name" || return 0
  echo "== $name at $(date +%T): $load $*"
  # shellcheck disable=SC2086  # the flags are words
  timeout 300 python3 benchmarks/probe_worker.py --paths serve --model "$dir/mlx" --voice "$dir/voice.safetensors" \
      --tokens 250 --cfm-dtype bfloat16 $load "$@" --out ~/res/vocoding_"$name".jsonl 2>&1 \
      | grep -E '^\| (closed|served|path|scenario)'
  echo "== $name ended with ${PIPESTATUS[0]}"
}
full="--requests 128 --streams 64"
probe thread "$full" --vocoding thread
probe interleaved "$full" --vocoding interleaved
probe process "$full" --vocoding process
probe interleaved2 "$full" --vocoding interleaved --t3-steps-per-part 2
streams="--requests 0 --streams 32"
probe thread32 "$streams" --vocoding thread
probe interleaved32 "$streams" --vocoding interleaved
probe process32 "$streams" --vocoding process
# T3 alone at 64 and 256 rows in bf16 and 10 s requests (issue 24's 15,000 tok/s at 256), the windows written by
# our attention kernel and, to compare, by slice_update (run U: 14,634 tok/s at 256 rows before the kernel wrote)
for how in "" --slice-update; do
  wanted batch && echo "== bench_batch $how at $(date +%T)" && timeout 300 python3 benchmarks/bench_batch.py \
      --concurrency 64,256 --tokens 250 --dtype bfloat16 $how --out ~/res/vocoding_batch.jsonl 2>&1 | grep -v '^{'
done
echo "== done"
