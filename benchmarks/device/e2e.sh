#!/usr/bin/env bash
# Text -> wav's open A/Bs in one lease (~7 minutes after the installs): bash benchmarks/device/start.sh e2e 540
# 1. The watermark's spectra on the device (watermark.SPECTRA_ON_DEVICE's default with MLX-CUDA since run AL,
#    where text -> wav's watermark took 11-15 ms against numpy's 42-50) against the host: text -> wav of 10 s
#    (bench_e2e --built full, bf16 estimator), alternating twice, into ~/res/e2e_mark.jsonl; then what run AL
#    left out, served English, 32 whole requests 16 at a time (the marking threads' work beside T3's steps on
#    the GPU), each way: a sitecustomize.py on SERVE_PATH puts the spectra back on the host in the server.
#    Served lines go to ~/res/serve_mark_<host|device>.jsonl.
# 2. S3Gen's memory budget (issue 25's goal: GPU peak of text -> wav <= upstream's 3,647 MiB; run AL: 3,643-4,147
#    at "auto", 1 GiB a request, 3,661 at 512 MiB for 0.12 s more): text -> wav at 512 and 256 MiB and
#    unbounded, into ~/res/e2e_budget.jsonl.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
for way in host device host device; do
  echo "== bench_e2e --mark-spectra $way"
  timeout 300 python3 benchmarks/bench_e2e.py --built full --cfm-dtype bfloat16 --mark-spectra $way \
      --out ~/res/e2e_mark.jsonl 2>&1 | grep -v '^{' | tail -1
done
host=/tmp/mark-host
mkdir -p $host
echo "from mlx_chatterbox.generation import watermark; watermark.SPECTRA_ON_DEVICE = False" > $host/sitecustomize.py
# After an unrecorded round of 16 short ones: run AK's first 16-request server compiled kernels in its round.
whole="--concurrency 16 --requests 32 --formats whole --warm-up-tokens 40"
for way in host device; do
  echo "== served English whole, marks on the $way at $(date +%T)"
  path=$([ $way = host ] && echo $host || echo "")
  SERVE_PATH=$path bash "$here/serve.sh" english "--cfm-dtype bfloat16" "$whole" > ~/res/serve_mark_$way.log 2>&1
  mv ~/res/serve.jsonl ~/res/serve_mark_$way.jsonl
  cp ~/res/serve_server.log ~/res/serve_mark_${way}_server.log
  grep '^| closed' ~/res/serve_mark_$way.log | head -1
done
for budget in 512 256 none auto; do
  echo "== bench_e2e --memory-budget $budget"
  timeout 300 python3 benchmarks/bench_e2e.py --built full --cfm-dtype bfloat16 --memory-budget $budget \
      --out ~/res/e2e_budget.jsonl 2>&1 | grep -v '^{' | tail -1
done
echo "== done"
