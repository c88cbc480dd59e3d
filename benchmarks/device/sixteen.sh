#!/usr/bin/env bash
# Why HiFT's convolution kernel (layers.KERNEL_CONVS) lost 3.7x at 16 served Turbo streams in run AR while it won
# alone, in ~8 minutes after the installs: bash benchmarks/device/start.sh sixteen 560 [ROUNDS [WAY ...]] (then
# wait.sh 560 sixteen)
# 1. probe_stream_decode.py: 16 streams' batched decodes replayed in one process (no T3 beside it), cuDNN and
#    the kernel alternating, ROUNDS times (default 1); then "kernel-host" (below) once in a process of its own.
# 2. Served Turbo, 16 streams at a time (run AR's scenario), each WAY in turn (default: kernel kernel-host
#    shipped, run AS's order). Run AS found the first 16-stream server on a machine slow whatever its way (it
#    compiles MLX's kernels for the batch shapes), so compare ways in alternation: 3 shipped kernel shipped kernel.
# The hypothesis (runs AE found it for T3's 4-byte scalars): MLX-CUDA keeps arrays made from host data in CUDA
# managed memory; if one shares a page with the small arrays a busy server keeps writing on the host, each host
# write moves the page to the CPU and the next kernel reading it faults it back. That would scale with the
# server's host activity, as the loss did, and stall the GPU for T3's process too (run AR: T3's steps 22.5 ms
# against 8.5). Every thread of the kernel reads its 4-int geometry; run AR's was made by mx.array(list). The
# library now copies it on the device (kernel_weight, as layers.DEVICE_SCALARS does for T3); "kernel-host"
# puts run AR's host-made array back.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
source "$here/ways.sh"
way kernel "$kernel_switch"
mkdir -p $ways/kernel-host
cat > $ways/kernel-host/sitecustomize.py <<'EOF'
import mlx.core as mx

from mlx_chatterbox.models import layers

layers.KERNEL_CONVS = True
_device_made = layers.kernel_weight


def _host_geometry(weight, dilation=1, left=0, right=0):
    made = _device_made(weight, dilation, left, right)
    return made._replace(geometry=mx.array(made.geometry.tolist(), dtype=mx.int32))  # as run AR's


layers.kernel_weight = _host_geometry
EOF
echo "== probe_stream_decode at $(date +%T)"
rounds=${1:-1}
shift
timeout 200 python3 benchmarks/probe_stream_decode.py --streams 16 --rounds $rounds --cfm-steps 2 \
    --out ~/res/stream_decode.jsonl 2>&1 | tail -4
echo "== probe_stream_decode, kernel-host at $(date +%T)"
PYTHONPATH=$(path kernel-host):$PYTHONPATH timeout 150 python3 benchmarks/probe_stream_decode.py \
    --streams 16 --rounds 1 --cfm-steps 2 --ways kernel --out ~/res/stream_decode_host.jsonl 2>&1 | tail -3
n=0
for way in ${@:-kernel kernel-host shipped}; do n=$((n + 1)); many sixteen_${n}_$way $way; done
echo "== done"
