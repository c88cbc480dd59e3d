#!/usr/bin/env bash
# HiFT's float32 convolutions as TF32 in the server's vocoding process only (MLX_ENABLE_TF32=1 there, 0 in the
# server's own process: T3 stays true float32), against the process as shipped, in one lease (~8 minutes after
# the installs): bash benchmarks/device/start.sh tf32 540
# A sitecustomize.py on SERVE_PATH sets the variable in spawned children alone (their command line holds
# --multiprocessing-fork): MLX reads it at its first float32 product or convolution (0.32.4, utils.h), so no
# library change is needed for the A/B. Served English (bf16 estimator) and Turbo, `--vocoding process` (the CUDA
# default), one stream at a time then 32 whole requests 16 at a time, each way, into
# ~/res/serve_tf32_<variant>_<shipped|tf32>.jsonl.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
tf32=/tmp/tf32-vocoding
mkdir -p $tf32
printf 'import os, sys\nif "--multiprocessing-fork" in sys.orig_argv:\n    os.environ["MLX_ENABLE_TF32"] = "1"\n' \
    > $tf32/sitecustomize.py
one="--concurrency 1 --requests 6 --formats streamed"
whole="--concurrency 16 --requests 32 --formats whole --warm-up-tokens 40"  # after a round that builds kernels
for variant in english turbo; do
  flags="--vocoding process --warm-batches off --first-chunk 15"
  [ $variant = english ] && flags="$flags --cfm-dtype bfloat16"
  for way in shipped tf32; do
    name=serve_tf32_${variant}_$way
    echo "== $name at $(date +%T)"
    path=$([ $way = tf32 ] && echo $tf32 || echo "")
    SERVE_PATH=$path bash "$here/named.sh" $name $variant "$flags" "$one" "$whole" | head -2
  done
done
echo "== done"
