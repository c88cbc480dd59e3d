#!/usr/bin/env bash
# Why HiFT's convolution kernel (layers.KERNEL_CONVS) lost 3.7x at 16 served Turbo streams in run AR while it won
# alone, in ~13 minutes after the installs: bash benchmarks/device/start.sh sixteen 560 (then wait.sh 560 sixteen)
# 1. probe_stream_decode.py: 16 streams' batched decodes replayed in one process (no T3 beside it), cuDNN and
#    the kernel; then "kernel-byvalue" (below).
# 2. Served Turbo, 16 streams at a time (run AR's scenario): kernel-byvalue, the kernel as it is, cuDNN.
# The hypothesis: MLX-CUDA puts arrays made from host data in CUDA managed memory, and its buffer cache hands such
# buffers to later GPU outputs too. If a small one shares a page with the arrays a busy server keeps writing on
# the host, each host write moves the page to the CPU and the next kernel reading it faults it back; that would
# scale with the server's host activity, as the loss did, and stall the GPU for T3's process too (run AR: T3's
# steps 22.5 ms against 8.5). The kernel reads one small array that cuDNN's path does not: its 4-int geometry
# (made by mx.array(list)), in every thread. "kernel-byvalue" reads none: the geometry comes as the shape of a
# bool array the kernel never reads (C_out, dilation, left + 1, right + 1), which MLX passes by value.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
ways=/tmp/ways
mkdir -p $ways/kernel $ways/kernel-byvalue
printf 'from mlx_chatterbox.models import layers\n\nlayers.KERNEL_CONVS = True\n' > $ways/kernel/sitecustomize.py
cat > $ways/kernel-byvalue/sitecustomize.py <<'EOF'
import mlx.core as mx

from mlx_chatterbox.models import layers

layers.KERNEL_CONVS = True
layers._CONV_SOURCE = (
    layers._CONV_SOURCE.replace("geometry[0]", "geometry_shape[0]")
    .replace("geometry[1]", "geometry_shape[1]")
    .replace("geometry[2]", "(geometry_shape[2] - 1)")
    .replace("geometry[3]", "(geometry_shape[3] - 1)")
)
_host_made = layers.kernel_weight


def _by_value(weight, dilation=1, left=0, right=0):
    made = _host_made(weight, dilation, left, right)
    # The geometry as the shape of an array the kernel never reads: MLX passes shapes by value.
    return made._replace(geometry=mx.zeros((made.c_out, dilation, made.left + 1, made.right + 1), mx.bool_))


layers.kernel_weight = _by_value
EOF
path() {  # a way's sitecustomize folder (none for shipped)
  [ "$1" = shipped ] || echo $ways/$1
}
echo "== probe_stream_decode at $(date +%T)"
timeout 200 python3 benchmarks/probe_stream_decode.py --streams 16 --rounds 1 --cfm-steps 2 \
    --out ~/res/stream_decode.jsonl 2>&1 | tail -4
echo "== probe_stream_decode, kernel-byvalue at $(date +%T)"
PYTHONPATH=$(path kernel-byvalue):$PYTHONPATH timeout 150 python3 benchmarks/probe_stream_decode.py \
    --streams 16 --rounds 1 --cfm-steps 2 --ways kernel --out ~/res/stream_decode_byvalue.jsonl 2>&1 | tail -3
for way in kernel-byvalue kernel shipped; do
  echo "== served turbo, 16 at a time, $way at $(date +%T)"
  SERVE_PATH=$(path $way) bash "$here/named.sh" sixteen_$way turbo "--first-chunk 15 --cfm-dtype bfloat16" \
      "--concurrency 16 --requests 48 --tokens 250 --tokens-spread 100 --formats streamed"
done
echo "== done"
