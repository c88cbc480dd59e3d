#!/usr/bin/env bash
# Whether cuDNN's per-shape convolution graphs are why a stream's decodes are slow in the vocoding process
# (issue 25), in one lease (~14 minutes after the installs; a later call waits on with wait.sh):
#   bash benchmarks/device/start.sh caches 560
# Run AO (H100, Turbo, bf16 estimator, first chunk 15, probe_first_audio's worker-process): the first decode took
# 54 ms at a 100-token budget, 65 at 150, 155 at 250 and 140 at 400; served at 250 tokens it was ~60 or ~160 ms,
# and the stream's later decodes, each of a length not met before (catch-up), 140-350 ms. MLX-CUDA builds a
# cuDNN graph for every convolution shape and keeps 128 per thread (MLX_CUDA_CONV_CACHE_SIZE); a decode runs
# about 41 shapes (HiFT 37, counted on the CPU with MLX's convolutions in place of ours), and in the server's
# log of decodes a first decode was slow exactly after a stream whose later decodes brought more than ~128 new
# shapes. The thrashing check is off (_backend.py), so a miss rebuilds without a word.
# Ways: MLX as shipped (128), MLX_CUDA_CONV_CACHE_SIZE=1024, and our products in place of MLX's convolutions
# (layers.PRODUCT_CONVS_OFF_CPU, set by a sitecustomize.py on the path of every process, the vocoding one too);
# the probe first with the check on (which cache raises). Then served, one stream at a time, 250 tokens.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
products=/tmp/product-convs
mkdir -p $products
printf 'from mlx_chatterbox.models import layers\n\nlayers.PRODUCT_CONVS_OFF_CPU = True\n' > $products/sitecustomize.py
python3 -m pytest -q -p no:cacheprovider tests/test_layers.py 2>&1 | tail -1
probe() {  # variant, tokens, way (shipped, cache1024, products, check)
  local dir=/tmp/serve-$1 settings=()
  case $4 in
    cache1024) settings=(MLX_CUDA_CONV_CACHE_SIZE=1024) ;;
    products) settings=(PYTHONPATH=$products:$PYTHONPATH) ;;
    check) settings=(MLX_ENABLE_CACHE_THRASHING_CHECK=1) ;;
  esac
  echo "== probe $1, $2 tokens, $4 at $(date +%T)"
  env "${settings[@]}" timeout 150 python3 benchmarks/probe_first_audio.py --model $dir/mlx \
      --voice $dir/voice.safetensors --modes worker-process --cfm-dtype bfloat16 --first-chunk 15 --tokens "$2" \
      --mark-threads 1 --max-batch 128 --repeats 6 --out ~/res/first_audio_caches_$4.jsonl 2>&1 |
    grep -E '^\| worker|hrash|Error'
}
bash "$here/model.sh" turbo
bash "$here/model.sh" english
probe turbo 250 check
for way in shipped cache1024 products; do probe turbo 250 $way; done
for way in shipped products; do probe turbo 100 $way; done
for way in shipped products; do probe english 250 $way; done
# Then whole requests one at a time, each of its own length (--tokens-spread): text -> wav as real text meets it.
one="--concurrency 1 --requests 8 --tokens 250"
flags="--warm-batches off --first-chunk 15 --cfm-dtype bfloat16"
echo "== served, shipped at $(date +%T)"
bash "$here/named.sh" caches_shipped turbo "$flags" "$one --formats streamed" "$one --formats whole --tokens-spread 100"
echo "== served, cache1024 at $(date +%T)"
MLX_CUDA_CONV_CACHE_SIZE=1024 bash "$here/named.sh" caches_cache1024 turbo "$flags" "$one --formats streamed" \
    "$one --formats whole --tokens-spread 100"
echo "== served, products at $(date +%T)"
SERVE_PATH=$products bash "$here/named.sh" caches_products turbo "$flags" "$one --formats streamed" \
    "$one --formats whole --tokens-spread 100"
echo "== done"
