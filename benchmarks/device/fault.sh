#!/usr/bin/env bash
# Run AV's vocoding-process fault ("unspecified launch failure", then SIGABRT) with 16 English streams and a
# first chunk of 10, found way by way (~8 minutes): bash benchmarks/device/start.sh fault 560
# 1. The 16 streams' batched decodes replayed in one process (probe_stream_decode, bf16 estimator, 10 steps),
#    HiFT's convolutions by our kernel, then by cuDNN: a fault in one way only names the kernel.
# 2. Served as run AV served it (first.sh's chunk10 way, 16 at a time), cuDNN's way then the kernel's.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
source "$here/ways.sh"
echo "== commit $BENCH_COMMIT"
for way in kernel cudnn; do
  echo "== replay, 16 English streams, first chunk 10, $way at $(date +%T)"
  timeout 200 python3 benchmarks/probe_stream_decode.py --streams 16 --first-chunk 10 --ways $way --rounds 1 \
      --out ~/res/fault.jsonl > ~/res/fault_replay_$way.log 2>&1
  echo "rc $?"
  grep -e '^|' -e Error ~/res/fault_replay_$way.log | tail -4
done
flags="--warm-batches off --first-chunk 10 --cfm-dtype bfloat16 -v"
many="--concurrency 16 --requests 32 --formats streamed --warm-up-tokens 40"
for way in cudnn shipped; do
  echo "== served English chunk10, 16 at a time, $way at $(date +%T)"
  SERVE_PATH=$(path $way) bash "$here/named.sh" fault_served_$way english "$flags" "$many"
  grep -e 'launch failure' -e 'exit code' ~/res/fault_served_${way}_server.log | sort | uniq -c | head -4
done
echo "== done"
