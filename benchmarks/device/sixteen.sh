#!/usr/bin/env bash
# Why HiFT's convolution kernel (layers.KERNEL_CONVS) lost 3.7x at 16 served Turbo streams in run AR while it won
# alone, in ~13 minutes after the installs: bash benchmarks/device/start.sh sixteen 560 (then wait.sh 560 sixteen)
# 1. probe_stream_decode.py: 16 streams' batched decodes replayed in one process (no T3 beside it), cuDNN and
#    the kernel; then "kernel-device" (below).
# 2. Served Turbo, 16 streams at a time (run AR's scenario): kernel-device, the kernel as it is, cuDNN.
# The hypothesis: MLX-CUDA puts arrays made from host data in CUDA managed memory, and its buffer cache hands such
# buffers to later GPU outputs too. If a small one shares a page with the arrays a busy server keeps writing on
# the host, each host write moves the page to the CPU and the next kernel reading it faults it back; that would
# scale with the server's host activity, as the loss did, and stall the GPU for T3's process too (run AR: T3's
# steps 22.5 ms against 8.5). The kernel reads one small array that cuDNN's path does not: its 4-int geometry
# (made by mx.array(list)), in every thread. "kernel-device" pads it on the GPU: a GPU op's output, in device
# memory unless MLX's cache hands it a managed buffer of the same size.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
ways=/tmp/ways
mkdir -p $ways/kernel $ways/kernel-device
printf 'from mlx_chatterbox.models import layers\n\nlayers.KERNEL_CONVS = True\n' > $ways/kernel/sitecustomize.py
cat > $ways/kernel-device/sitecustomize.py <<'EOF'
import mlx.core as mx

from mlx_chatterbox.models import layers

layers.KERNEL_CONVS = True
_host_made = layers.kernel_weight


def _device_geometry(*args, **kwargs):
    made = _host_made(*args, **kwargs)
    return made._replace(geometry=mx.pad(made.geometry, (0, 4)))  # a GPU op's output


layers.kernel_weight = _device_geometry
EOF
path() {  # a way's sitecustomize folder (none for shipped)
  [ "$1" = shipped ] || echo $ways/$1
}
echo "== probe_stream_decode at $(date +%T)"
timeout 200 python3 benchmarks/probe_stream_decode.py --streams 16 --rounds 1 --cfm-steps 2 \
    --out ~/res/stream_decode.jsonl 2>&1 | tail -4
echo "== probe_stream_decode, kernel-device at $(date +%T)"
PYTHONPATH=$(path kernel-device):$PYTHONPATH timeout 150 python3 benchmarks/probe_stream_decode.py \
    --streams 16 --rounds 1 --cfm-steps 2 --ways kernel --out ~/res/stream_decode_device.jsonl 2>&1 | tail -3
for way in kernel-device kernel shipped; do
  echo "== served turbo, 16 at a time, $way at $(date +%T)"
  SERVE_PATH=$(path $way) bash "$here/named.sh" sixteen_$way turbo "--first-chunk 15 --cfm-dtype bfloat16" \
      "--concurrency 16 --requests 48 --tokens 250 --tokens-spread 100 --formats streamed"
done
echo "== done"
