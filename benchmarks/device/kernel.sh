#!/usr/bin/env bash
# HiFT's float32 convolutions as our kernel (layers.KERNEL_CONVS: plans nothing, one launch takes the mask, the
# bias and the residual sum) against the shipped library (MLX's cuDNN convolutions, 1,024 graphs a thread), in
# ~17 minutes after the installs (a second call waits on with wait.sh): bash benchmarks/device/start.sh kernel 560
# Run AQ (H100) had the kernel fastest wherever it had been compiled, but that version compiled one per
# convolution shape (~60, 0.6 s each) and stalled served requests; now its sizes come at run time, and whether
# it reads a bias, a mask and a sum: one kernel per tile height, both compiled at a process's first kernel
# convolution. If served whole requests and 16 streams hold shipped's p95 and TTFA with the kernel, and
# text -> wav keeps run AQ's gain, KERNEL_CONVS becomes the default on CUDA. In the order of what decides:
# 1. The GPU tests of test_layers (the kernel against MLX's convolutions at HiFT's sizes).
# 2. probe_hift.py, shipped and kernel: a 10 s decode warm (its first call compiles), the first call at new
#    lengths, 4 rows in one call, primitives.
# 3. S3Gen alone, 10 s prompt + 10 s (probe_s3gen's batch of 1: issue 25's RTF 0.01), fp32 and bf16 estimator.
# 4. Served Turbo one stream at a time (first audio, and whole requests of 250 ± 100 tokens), 16 streams at a
#    time (run AQ: TTFA p50 0.97 s shipped), text -> wav of 250 ± 100 tokens with the bf16 estimator (bench_e2e,
#    each stage's peak), served English one at a time (issue 25's first audio), then text -> wav with the fp32
#    estimator (whose causal convolutions take the kernel too): kernel and shipped each.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
source "$here/ways.sh"
way kernel "$kernel_switch"
echo "== tests at $(date +%T)"
python3 -m pytest -q -p no:cacheprovider tests/test_layers.py -k cuda 2>&1 | tail -4
echo "== probe_hift at $(date +%T)"
timeout 300 python3 benchmarks/probe_hift.py --ways shipped,kernel --out ~/res/probe_hift.jsonl 2>&1 | tail -6
for way in shipped kernel; do
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
for way in shipped kernel; do served turbo $way; done
many kernel_c16_kernel kernel
many kernel_c16_shipped shipped
e2e kernel bfloat16
e2e shipped bfloat16
for way in shipped kernel; do served english $way; done
e2e kernel float32  # the estimator's causal convolutions take the kernel too
e2e shipped float32
echo "== done"
