#!/usr/bin/env bash
# HiFT at rung lengths (hift.LENGTH_RUNGS) against the shipped library, whose MLX-CUDA now keeps 1,024
# cuDNN convolution graphs a thread (_backend.py, from run AP), in one lease (~18 minutes after the installs;
# a second call waits on with wait.sh): bash benchmarks/device/start.sh rungs 560
# Run AP (H100): a new length costs ~100-170 ms of graph building. A cache of 1,024 took a lone served Turbo
# stream's first audio from 217 to 115 ms (its first chunk's graphs stay), but not whole requests of varied
# length (800 ms either way: each length is new); our im2col products, which need no graph, took those to 631
# ms and ran a 16-stream server out of memory. Rungs pad HiFT to few lengths (at most 1/8 more frames, masked)
# so that its ~37 shapes recur. Since then our products sum one product per kernel tap for long inputs
# (layers.conv1d: no k-fold copy of the input), so products may now fit 16 streams. Ways: shipped, rungs, taps
# (layers.PRODUCT_CONVS_OFF_CPU: our products, HiFT's as taps); a sitecustomize.py on the path of every
# process, the vocoding one too, switches each on.
# 1. tests/test_hift.py (the rungs' samples against the unpadded call), tests/test_layers.py (the products
#    against MLX's convolutions) and tests/test_backend.py on the GPU.
# 2. Text -> wav (bench_e2e --built full, bf16 estimator) at 250 tokens ± 100, each way, and shipped at one
#    length (issue 25's 0.48-0.55 s were measured so), into ~/res/e2e_rungs_<way>.jsonl, with the peak of
#    each stage.
# 3. Served Turbo (shipped, rungs, taps) and English (shipped, rungs), one stream at a time at 250 tokens
#    (first audio) and whole requests of 250 ± 100; then Turbo, 16 streams of 250 ± 100 at a time (run AP:
#    TTFA p50 1.20 s), shipped, rungs, rungs with 8,192 graphs a thread, and taps.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
rungs=/tmp/hift-rungs taps=/tmp/conv-taps
mkdir -p $rungs $taps
printf 'from mlx_chatterbox.models import hift\n\nhift.LENGTH_RUNGS = True\n' > $rungs/sitecustomize.py
printf 'from mlx_chatterbox.models import layers\n\nlayers.PRODUCT_CONVS_OFF_CPU = True\n' > $taps/sitecustomize.py
path() {  # a way's sitecustomize folder (none for shipped)
  case $1 in rungs*) echo $rungs ;; taps) echo $taps ;; esac
}
python3 -m pytest -q -p no:cacheprovider tests/test_hift.py tests/test_layers.py tests/test_backend.py 2>&1 | tail -1
e2e() {  # way, then bench_e2e's flags
  local way=$1
  shift
  echo "== bench_e2e $way $* at $(date +%T)"
  PYTHONPATH=$(path $way):$PYTHONPATH timeout 300 python3 benchmarks/bench_e2e.py --built full \
      --cfm-dtype bfloat16 --tokens 250 --repeats 5 "$@" --out ~/res/e2e_rungs_$way.jsonl 2>&1 | grep -v "^{" | tail -2
}
# In the order of what decides (the job may be cut short by the lease): the three ways' text -> wav and served
# Turbo, Turbo at 16 streams, then English served and text -> wav at one length.
for way in shipped rungs taps; do e2e $way --tokens-spread 100; done
one="--concurrency 1 --requests 8 --tokens 250"
served() {  # variant, way
  echo "== served $1, $2 at $(date +%T)"
  SERVE_PATH=$(path $2) bash "$here/named.sh" rungs_$1_$2 $1 "--warm-batches off --first-chunk 15 \
--cfm-dtype bfloat16" "$one --formats streamed" "$one --formats whole --tokens-spread 100"
}
for way in shipped rungs taps; do served turbo $way; done
# 16 streams batch 1-16 rows a decode, and every (rows, length) has its own graphs: ~28 rungs of 30-400 frames
# times 16 row counts times ~37 shapes is far past 1,024, hence a way with 8,192 (nvidia-smi's lines at the end
# of each log say what the graphs cost in device memory).
many="--concurrency 16 --requests 48 --tokens 250 --tokens-spread 100 --formats streamed"
for way in shipped taps rungs rungs8192; do
  echo "== served turbo, 16 at a time, $way at $(date +%T)"
  size=$([ $way = rungs8192 ] && echo 8192 || echo 1024)
  MLX_CUDA_CONV_CACHE_SIZE=$size SERVE_PATH=$(path $way) bash "$here/named.sh" \
      rungs_c16_$way turbo "--first-chunk 15 --cfm-dtype bfloat16" "$many"
done
for way in shipped rungs; do served english $way; done
e2e shipped
echo "== done"
