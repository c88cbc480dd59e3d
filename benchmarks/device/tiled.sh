#!/usr/bin/env bash
# The estimator's products, convolutions and norms as our kernel (cfm.tiled_product, on by default) against
# MLX's cuBLAS and cuDNN calls, in one lease (about 6 minutes after the installs):
#   bash benchmarks/device/start.sh tiled 560
# Its GPU tests first (not their CPU runs, which CI has); the timings run whatever they say (a failing
# kernel's cost is still worth knowing), each pair alternating in one process where the probe allows it.
# With abtree/ (an earlier commit's mlx_chatterbox and benchmarks, made here before the call:
#   mkdir abtree && git archive REV mlx_chatterbox benchmarks | tar -x -C abtree && rm -r abtree/benchmarks/results
#   && rm -r abtree/mlx_chatterbox/assets && ln -s ../../mlx_chatterbox/assets abtree/mlx_chatterbox/assets)
# its kernel's probes run too, alternating with this tree's: ~/res/kernels_ab.jsonl and s3gen_probe_ab.jsonl
# against kernels_now.jsonl and s3gen_probe_now.jsonl.
# Results in ~/res/*.jsonl.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
echo "== commit $BENCH_COMMIT"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_tiled_products.py -k "not on_the_cpu" 2>&1 | tail -15
for frames in 530 1000; do  # a stream's first decode (10 s prompt + 15 tokens); 10 s after a 10 s prompt
  timeout 300 python3 benchmarks/probe_s3gen.py --part call,solve --dtypes bfloat16 --rows 1 --frames "$frames" \
      --estimator plain,tiled,plain,tiled --out ~/res/s3gen_probe.jsonl
done
for rows in 1 8; do  # one request (GPU time a call at 1,000 frames), a batch of 8 (where the GPU bounds a call)
  MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=1000000 timeout 300 python3 benchmarks/probe_s3gen.py \
      --part device --dtypes bfloat16 --rows "$rows" --estimator plain,tiled --out ~/res/s3gen_probe.jsonl
done
timeout 300 python3 benchmarks/probe_s3gen.py --part call --dtypes bfloat16 --rows 8 --frames 1000 \
    --estimator plain,tiled,plain,tiled --out ~/res/s3gen_probe.jsonl
timeout 300 python3 benchmarks/probe_kernels.py --part s3gen --systems ours,ours-plain-products,ours-tiles-32 \
    --out ~/res/kernels.jsonl 2>&1 | grep -v '^{'
if [ -d abtree ]; then  # the earlier kernel against this one, twice each, alternating
  for tree in ab now ab now; do
    echo "== $tree"
    root=$([ $tree = ab ] && echo abtree || echo .)
    timeout 300 python3 $root/benchmarks/probe_kernels.py --part s3gen --out ~/res/kernels_$tree.jsonl 2>&1 \
        | grep -v '^{'
    for frames in 530 1000; do
      timeout 300 python3 $root/benchmarks/probe_s3gen.py --part solve --dtypes bfloat16 --rows 1 \
          --frames "$frames" --estimator tiled --out ~/res/s3gen_probe_$tree.jsonl
    done
  done
fi
for graphs in 1 0; do  # with CUDA graphs (TTS in one process), without (the server's vocoding process)
  for plain in "" --plain-products; do
    MLX_USE_CUDA_GRAPHS=$graphs timeout 300 python3 benchmarks/probe_first_audio.py --modes stream $plain \
        --out ~/res/first_audio.jsonl
  done
done
for plain in "" --plain-products "" --plain-products; do
  timeout 300 python3 benchmarks/bench_e2e.py --built full --cfm-dtype bfloat16 $plain --out ~/res/e2e.jsonl
done
echo "== done"
