#!/usr/bin/env bash
# Issue 25's peak memory, ours alone on a built full-size English model (no torch, ~6 minutes):
#   bash benchmarks/device/start.sh memory 560
# T3's prefill unbounded (the default), then under memory.PREFILL_BUDGET_PER_ROW = 128 MiB (run AX), with S3Gen's
# "auto" budget; then S3Gen's budget at 256 MiB, and the fp32 estimator's attention in pieces of 2^22 scores
# (layers.FP32_ATTENTION_PIECE) at 256 MiB and auto (text -> wav of 250 tokens, fp32 estimator, bench_e2e's
# stage peaks: T3's prefill, its decode, S3Gen, the watermark).
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
source "$here/ways.sh"
way prefill128 'from mlx_chatterbox.models import memory

memory.PREFILL_BUDGET_PER_ROW = 128 * 2**20'
way pieces 'from mlx_chatterbox.models import layers

layers.FP32_ATTENTION_PIECE = 2**22'
echo "== commit $BENCH_COMMIT"
e2e() {  # way, S3Gen's budget
  echo "== text -> wav, $1, S3Gen budget $2 at $(date +%T)"
  PYTHONPATH=$(path $1)${PYTHONPATH:+:}$PYTHONPATH timeout 240 python3 benchmarks/bench_e2e.py --built full \
      --systems ours --tokens 250 --repeats 3 --memory-budget $2 --out ~/res/memory_$1.jsonl 2>&1 \
      | grep -v '^{' | tail -2
}
e2e shipped auto
e2e prefill128 auto
e2e shipped 256
e2e pieces 256
e2e pieces auto
echo "== done"
