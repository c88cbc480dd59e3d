#!/usr/bin/env bash
# Text -> wav's two open A/Bs in one lease (~8 minutes after the installs): bash benchmarks/device/start.sh e2e 540
# 1. The watermark's spectra on the device (watermark.SPECTRA_ON_DEVICE) against numpy on the host: text -> wav of
#    10 s (bench_e2e --built full, bf16 estimator), alternating host and device twice, into ~/res/e2e_mark.jsonl;
#    the host path's watermark under py-spy (spy.sh mark: which host parts take its 56-62 ms); then served
#    English, 32 whole requests 16 at a time (the marking threads' work), each way: a sitecustomize.py on
#    SERVE_PATH turns the device path on in the server. Served lines go to ~/res/serve_mark_<host|device>.jsonl.
# 2. S3Gen's memory budget (issue 25's goal: GPU peak of text -> wav <= upstream's 3,647 MiB; run AJ 3,643 at
#    "auto", 1 GiB a request): text -> wav at 512 and 256 MiB and unbounded, into ~/res/e2e_budget.jsonl.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
for way in "" --mark-on-device "" --mark-on-device; do
  echo "== bench_e2e $way"
  timeout 300 python3 benchmarks/bench_e2e.py --built full --cfm-dtype bfloat16 $way --out ~/res/e2e_mark.jsonl \
      2>&1 | grep -v '^{' | tail -3
done
echo "== spy.sh mark"
timeout 120 bash "$here/spy.sh" mark --workload mark 2>&1 | tail -25
device=/tmp/mark-device
mkdir -p $device
echo "from mlx_chatterbox.generation import watermark; watermark.SPECTRA_ON_DEVICE = True" > $device/sitecustomize.py
# After an unrecorded round of 16 short ones: run AK's first 16-request server compiled kernels in its round.
whole="--concurrency 16 --requests 32 --formats whole --warm-up-tokens 40"
for way in host device; do
  echo "== served English whole, marks on the $way at $(date +%T)"
  path=$([ $way = device ] && echo $device || echo "")
  SERVE_PATH=$path bash "$here/serve.sh" english "--cfm-dtype bfloat16" "$whole" > ~/res/serve_mark_$way.log 2>&1
  mv ~/res/serve.jsonl ~/res/serve_mark_$way.jsonl
  grep '^| closed' ~/res/serve_mark_$way.log | head -1
done
for budget in 512 256 none auto; do
  echo "== bench_e2e --memory-budget $budget"
  timeout 300 python3 benchmarks/bench_e2e.py --built full --cfm-dtype bfloat16 --memory-budget $budget \
      --out ~/res/e2e_budget.jsonl 2>&1 | grep -v '^{' | tail -2
done
echo "== done"
