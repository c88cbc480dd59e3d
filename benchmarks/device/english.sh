#!/usr/bin/env bash
# Issue 25's English first audio (goal 200 ms served; run AR 239, run AU 202 in one process), in ~9 minutes
# after the installs: bash benchmarks/device/start.sh english 560 (then wait.sh 560 english)
# 1. S3Gen's stages at a stream's first decode's size (the 10 s prompt and 15 tokens) and at 10 s, bf16
#    estimator (probe_s3gen --part batch --tokens): where run AU's 143 ms first decode goes.
# 2. A lone stream's first audio by event, in one process and through the Worker with its vocoding thread,
#    both warmed up as serve warms (run AU: the Worker marked the first chunk in 17 ms against 4, each marking
#    thread's first mark; Worker.warm_up now marks on every thread).
# 3. Served English one stream at a time, first chunk 15 and 10 (device/first.sh's process and chunk10 ways).
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
for tokens in 15 250; do
  echo "== probe_s3gen batch, $tokens tokens at $(date +%T)"
  timeout 200 python3 benchmarks/probe_s3gen.py --part batch --rows 1 --budgets auto --dtypes bfloat16 \
      --tokens $tokens --repeats 5 --out ~/res/s3gen_first.jsonl 2>&1 | tail -3
done
echo "== probe_first_audio at $(date +%T)"
timeout 240 python3 benchmarks/probe_first_audio.py --modes stream,worker-thread --tokens 250 --repeats 5 \
    --out ~/res/first_audio.jsonl 2>&1 | grep '^|'
WAYS="process chunk10" bash "$here/first.sh" english 2>&1 | grep -v "^{"
echo "== done"
