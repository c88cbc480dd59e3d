#!/usr/bin/env bash
# 64 streams at a time by where S3Gen runs, for `serve --vocoding auto` (~6 minutes after the installs):
#   bash benchmarks/device/start.sh many 560
# Run AA (H200) chose the process for Turbo's 64 streams (76x real time against the thread's 55x) when the process
# ran without CUDA graphs; run AL gave the process its graphs back (16 English streams 30.5x against 18.0x) and
# measured the thread as good or a little better at 1 and 16 streams. English (bf16 estimator) and Turbo, the
# process and the thread, each a fresh server: 128 streamed requests of 250 tokens 64 at a time, after an
# unrecorded round of 64 short ones. Lines go to ~/res/serve_many_<variant>_<way>.jsonl.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
many="--concurrency 64 --requests 128 --formats streamed --warm-up-tokens 40"
for variant in turbo english; do
  flags="--first-chunk 15 -v"
  [ $variant = english ] && flags="$flags --cfm-dtype bfloat16"
  for way in process thread; do
    name=serve_many_${variant}_$way
    echo "== $name at $(date +%T)"
    bash "$here/named.sh" $name $variant "$flags --vocoding $way" "$many"
  done
done
echo "== done"
