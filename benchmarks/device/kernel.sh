#!/usr/bin/env bash
# HiFT's float32 convolutions as our kernel (layers.KERNEL_CONVS, shipped since run AT: plans nothing, one launch
# takes the mask, the bias and the residual sum) against MLX's cuDNN convolutions (1,024 graphs a thread), in
# ~17 minutes after the installs (a second call waits on with wait.sh): bash benchmarks/device/start.sh kernel 560
# Runs AQ-AT (H100) weighed it this way and made it the default (ADR 6). In the order of what decides:
# 1. The GPU tests of test_layers (the kernel against MLX's convolutions at HiFT's sizes).
# 2. probe_hift.py, cudnn and kernel: a 10 s decode warm (its first call compiles), the first call at new
#    lengths, 4 rows in one call, primitives.
# 3. S3Gen alone, 10 s prompt + 10 s (probe_s3gen's batch of 1: issue 25's RTF 0.01), fp32 and bf16 estimator.
# 4. Served Turbo one stream at a time (first audio, and whole requests of 250 ± 100 tokens), 16 streams at a
#    time (cudnn, shipped, cudnn), text -> wav of 250 ± 100 tokens with the bf16 estimator (bench_e2e, each
#    stage's peak), served English one at a time (issue 25's first audio), then text -> wav with the fp32
#    estimator (whose causal convolutions take the kernel too): shipped and cudnn each.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
source "$here/ways.sh"  # the cudnn way
echo "== tests at $(date +%T)"
python3 -m pytest -q -p no:cacheprovider tests/test_layers.py -k cuda 2>&1 | tail -4
echo "== probe_hift at $(date +%T)"
timeout 300 python3 benchmarks/probe_hift.py --ways cudnn,kernel --out ~/res/probe_hift.jsonl 2>&1 | tail -6
for way in cudnn shipped; do
  echo "== probe_s3gen batch $way at $(date +%T)"
  PYTHONPATH=$(path $way):$PYTHONPATH timeout 300 python3 benchmarks/probe_s3gen.py --part batch --rows 1 \
      --budgets auto --repeats 5 --out ~/res/s3gen_kernel_$way.jsonl 2>&1 | tail -6
done
one="--concurrency 1 --requests 8 --tokens 250"
served() {  # variant, way
  echo "== served $1, $2 at $(date +%T)"
  SERVE_PATH=$(path $2) bash "$here/named.sh" kernel_$1_$2 $1 "--warm-batches off --first-chunk 15 \
--cfm-dtype bfloat16" "$one --formats streamed" "$one --formats whole --tokens-spread 100"
}
e2e() {  # way, the estimator's dtype
  echo "== bench_e2e $1 $2 at $(date +%T)"
  PYTHONPATH=$(path $1):$PYTHONPATH timeout 300 python3 benchmarks/bench_e2e.py --built full \
      --cfm-dtype $2 --tokens 250 --tokens-spread 100 --repeats 5 --out ~/res/e2e_kernel_$1.jsonl 2>&1 \
      | grep -v "^{" | tail -2
}
for way in cudnn shipped; do served turbo $way; done
many kernel_c16_cudnn cudnn
many kernel_c16_shipped shipped
many kernel_c16_cudnn2 cudnn  # alternated: a machine's first 16-stream server is slow (run AS)
e2e shipped bfloat16
e2e cudnn bfloat16
for way in cudnn shipped; do served english $way; done
e2e shipped float32  # the estimator's causal convolutions take the kernel too
e2e cudnn float32
echo "== done"
