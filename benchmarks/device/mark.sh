#!/usr/bin/env bash
# The watermark's spectra on the device (watermark.SPECTRA_ON_DEVICE) against numpy on the host, in one lease
# (~6 minutes after the installs): bash benchmarks/device/start.sh mark 400
# Text -> wav of 10 s (bench_e2e --built full, bf16 estimator), alternating host and device twice, into
# ~/res/e2e_mark.jsonl; the host path's watermark under py-spy (spy.sh mark: which host parts take its 56-62 ms);
# then served English, 32 whole requests 16 at a time (the marking threads' work), each way: a sitecustomize.py
# on SERVE_PATH turns the device path on in the server. Served lines go to ~/res/serve_mark_<host|device>.jsonl.
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
whole="--concurrency 16 --requests 32 --formats whole"
for way in host device; do
  echo "== served English whole, marks on the $way at $(date +%T)"
  path=$([ $way = device ] && echo $device || echo "")
  SERVE_PATH=$path bash "$here/serve.sh" english "--cfm-dtype bfloat16" "$whole" > ~/res/serve_mark_$way.log 2>&1
  mv ~/res/serve.jsonl ~/res/serve_mark_$way.jsonl
  grep '^| closed' ~/res/serve_mark_$way.log | head -1
done
echo "== done"
