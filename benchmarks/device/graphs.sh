#!/usr/bin/env bash
# The server with MLX-CUDA's graphs of 20 kernels (the package's default since run BA) against MLX's 100, in ~8
# minutes after the installs: bash benchmarks/device/start.sh graphs 560
# Run BA measured graphs of 20 in one process only (text -> wav 0.5-0.8 GB lower and as fast, a lone stream's
# first audio as soon); served, T3's batched steps make ~5x more graphs a step and the vocoding process's
# batched decodes run under the same bound. English (bf16 estimator, first chunk 15): 6 streams one at a time,
# then 32 streams 16 at a time after an unrecorded round (device/first.sh's scenarios), a fresh server each way,
# MLX's graphs (MLX_MAX_OPS_PER_BUFFER=100 in the server's environment, which its vocoding process inherits)
# first, then the default. bench_serve's lines carry the setting in their "env" (the client has it too).
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
flags="--warm-batches off --first-chunk 15 --cfm-dtype bfloat16 -v"
one="--concurrency 1 --requests 6 --formats streamed"
many="--concurrency 16 --requests 32 --formats streamed --warm-up-tokens 40"
for ops in 100 20; do
  echo "== served English, graphs of $ops kernels at $(date +%T)"
  MLX_MAX_OPS_PER_BUFFER=$ops bash "$here/named.sh" graphs_$ops english "$flags" "$one" "$many"
  grep -c -e Traceback -e failed ~/res/graphs_${ops}_server.log | sed 's/^/server log lines with Traceback or failed: /'
done
echo "== done"
