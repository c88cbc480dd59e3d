#!/usr/bin/env bash
# Served first audio by where S3Gen runs, in one lease (~7 minutes after the installs):
#   bash benchmarks/device/start.sh first 560 [VARIANT...]   (turbo english unless named; english alone ~5 minutes;
#   turbo-bf16: Turbo with the bf16 estimator)
# Ways (WAYS, default "process thread"), each a fresh server: "process" as shipped (the vocoding process with CUDA
# graphs and the tiled products); "nographs", the process with MLX_USE_CUDA_GRAPHS=0 from the server's
# environment (which also keeps the estimator on MLX's products; run AL: worse on every count); "thread"
# (--vocoding thread); "graphcache", the process with MLX_CUDA_GRAPH_CACHE_SIZE=4000 (MLX's default 400: each
# stream's CUDA graphs in an LRU cache keyed by the ops' topology; a server's many kinds of call may evict a first
# decode's graphs, which are then instantiated anew; run AN: no gain, first audio 320 against 277 ms English,
# 243 against 206 Turbo); "chunk10", the process with --first-chunk 10 (5 fewer T3 steps before the first
# decode, whose audio is then 0.14 s long, not 0.34). (Run AM also served the first-audio hold of f3b03c4 each
# way: no first audio won.)
# Turbo (fp32 estimator, as the default serves it) one stream at a time; English (bf16 estimator) one stream at a
# time, then on the same server 16 streams at a time after bench_serve's unrecorded round of 16 short ones (run
# AK's first 16-stream server met new decode shapes and compiled their kernels inside the measured round). Each
# start takes most of a minute. Lines go to ~/res/serve_<variant>_<way>.jsonl, each server's log to
# ~/res/serve_<variant>_<way>_server.log.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
served() {  # name, way, variant, server flags, scenarios...; serve.sh's own "== done" stays in its log
  echo "== $1 at $(date +%T)"
  local name=$1 way=$2 variant=$3 flags="$4 -v" env=()  # -v: the log says how the vocoding process runs MLX
  shift 4
  [ "$way" = thread ] && flags="$flags --vocoding thread"
  [ "$way" = chunk10 ] && flags="${flags/--first-chunk 15/--first-chunk 10}"
  [ "$way" = nographs ] && env=(MLX_USE_CUDA_GRAPHS=0)  # T3's steps in the server's process without them too
  [ "$way" = graphcache ] && env=(MLX_CUDA_GRAPH_CACHE_SIZE=4000)  # the vocoding process inherits it
  env "${env[@]}" bash "$here/named.sh" "$name" "$variant" "$flags" "$@"
  grep -c -e Traceback -e 'failed' ~/res/"$name"_server.log | sed 's/^/server log lines with Traceback or failed: /'
  grep -e 'runs MLX with' -e 'serving mlx' ~/res/"$name"_server.log | head -2
}
one="--concurrency 1 --requests 6 --formats streamed"
many="--concurrency 16 --requests 32 --formats streamed --warm-up-tokens 40"
variants=("$@")
[ $# -gt 0 ] || variants=(turbo english)
for way in ${WAYS:-process thread}; do
  for variant in "${variants[@]}"; do
    flags="--warm-batches off --first-chunk 15"
    case $variant in english | *-bf16) flags="$flags --cfm-dtype bfloat16" ;; esac
    if [ "$variant" = english ]; then
      served serve_english_$way $way english "$flags" "$one" "$many"
    else
      served serve_${variant}_$way $way "${variant%-bf16}" "$flags" "$one"
    fi
  done
done
echo "== done"
