#!/usr/bin/env bash
# Issue 25's peak memory against MLX-CUDA's graph sizes, ours alone on a built full-size English model (no
# torch, ~6 minutes): bash benchmarks/device/start.sh memory 560
# A kernel's inputs and each cuBLAS/cuDNN workspace stay allocated until the CUDA graph they belong to has run;
# MLX closes a graph after MLX_MAX_OPS_PER_BUFFER kernels (100 on Hopper) or once its inputs pass
# MLX_MAX_MB_PER_BUFFER (1,000 on Hopper; counted in elements by MLX 0.32's source, so ~4 GB of fp32), each read
# once a process. Text -> wav of 250 tokens (fp32 estimator, S3Gen's "auto" budget, bench_e2e's stage peaks) at
# each setting, the default first and last; then a lone stream's first audio (bf16 estimator) at the default and
# the two smallest graphs. (Run AY measured T3's prefill bound and the fp32 attention in pieces here: neither
# lowered the peak enough to pay, RESULTS.)
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
echo "== commit $BENCH_COMMIT"
settings=(default "MLX_MAX_MB_PER_BUFFER=200" "MLX_MAX_MB_PER_BUFFER=50" "MLX_MAX_OPS_PER_BUFFER=50"
  "MLX_MAX_OPS_PER_BUFFER=20" default)
for s in "${settings[@]}"; do
  echo "== text -> wav, $s at $(date +%T)"
  [ "$s" = default ] && s=BENCH_SETTING=default  # env needs a NAME=VALUE
  env "$s" timeout 240 python3 benchmarks/bench_e2e.py --built full --systems ours --tokens 250 --repeats 3 \
      --out ~/res/memory_graphs.jsonl 2>&1 | grep -v '^{' | tail -2
done
for s in BENCH_SETTING=default MLX_MAX_MB_PER_BUFFER=50 MLX_MAX_OPS_PER_BUFFER=20; do
  echo "== first audio, $s at $(date +%T)"
  env "$s" timeout 200 python3 benchmarks/probe_first_audio.py --modes stream,stream --tokens 250 --repeats 5 \
      --out ~/res/memory_first_audio.jsonl 2>&1 | grep '^| s'
done
echo "== done"
