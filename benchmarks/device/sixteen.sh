#!/usr/bin/env bash
# HiFT's convolution kernel (layers.KERNEL_CONVS, the default since run AT) against MLX's cuDNN convolutions at 16
# streams, in ~9 minutes after the installs: bash benchmarks/device/start.sh sixteen 560 [ROUNDS [WAY ...]] (then
# wait.sh 560 sixteen)
# 1. probe_stream_decode.py: 16 streams' batched decodes replayed in one process (no T3 beside it), cuDNN and
#    the kernel alternating, ROUNDS times (default 3; the first pays each way's compiles and plans).
# 2. Served Turbo, 16 streams at a time (run AR's scenario), each WAY in turn (default: cudnn shipped cudnn
#    shipped). Alternate them: the first 16-stream server on a machine is slow whatever its way when no kernel
#    cache was carried (run AS), which is what made run AR's kernel look 3.7x slower.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
source "$here/ways.sh"  # the cudnn way
echo "== probe_stream_decode at $(date +%T)"
timeout 200 python3 benchmarks/probe_stream_decode.py --streams 16 --rounds ${1:-3} --cfm-steps 2 \
    --out ~/res/stream_decode.jsonl 2>&1 | tail -7
shift
n=0
for way in ${@:-cudnn shipped cudnn shipped}; do n=$((n + 1)); many sixteen_${n}_$way $way; done
echo "== done"
