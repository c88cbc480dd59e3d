#!/usr/bin/env bash
# Served first audio by where S3Gen runs, in one lease (~9 minutes after the installs):
#   bash benchmarks/device/start.sh first 560
# Run AK (H100): a lone English stream's first audio 0.46 s p50 served with the vocoding process (as shipped on
# CUDA: no CUDA graphs, so MLX's products, not our tiled kernel) against 0.27 s in run AJ with the vocoding
# thread (graphs and the tiled kernel), and the process took 0.43 s a stream decode against the thread's 0.24.
# Three ways, each a fresh server: "process" as shipped; "graphs", the process with MLX_USE_CUDA_GRAPHS=1 from
# the server's environment (kept by vocoding._process_main, which then turns the tiled products on); "thread"
# (--vocoding thread). English (bf16 estimator) and Turbo one stream at a time, then English 16 streams at a
# time after an unrecorded round of 16 short ones (run AK's first 16-stream server met new decode shapes and
# compiled their kernels inside the measured round). Lines go to ~/res/serve_<variant>_<way>[_16].jsonl.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
served() {  # name, way, variant, server flags, scenario; serve.sh's own "== done" stays in its log
  echo "== $1 at $(date +%T)"
  local flags="$4 -v" env=()  # -v: the log says how the vocoding process runs MLX
  [ "$2" = thread ] && flags="$flags --vocoding thread"
  [ "$2" = graphs ] && env=(MLX_USE_CUDA_GRAPHS=1)  # unset otherwise: MLX's default in the server's process
  env "${env[@]}" bash "$here/serve.sh" "$3" "$flags" "$5" > ~/res/"$1".log 2>&1
  mv ~/res/serve.jsonl ~/res/"$1".jsonl
  grep '^| closed' ~/res/"$1".log | head -2  # the scenario's row, then its Server-Timing medians
  grep -e 'runs MLX with' -e 'serving mlx' ~/res/serve_server.log | head -2
}
one="--concurrency 1 --requests 6 --formats streamed"
for variant in english turbo; do
  flags="--warm-batches off --first-chunk 15"
  [ $variant = english ] && flags="$flags --cfm-dtype bfloat16"
  for way in process graphs thread; do
    served serve_${variant}_$way $way $variant "$flags" "$one"
  done
done
many="--concurrency 16 --requests 32 --formats streamed --warm-up-tokens 40"
for way in process graphs thread; do
  served serve_english_${way}_16 $way english "--cfm-dtype bfloat16" "$many"
done
echo "== done"
