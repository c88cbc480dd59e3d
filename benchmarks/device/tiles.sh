#!/usr/bin/env bash
# The tiled kernel's wide tiles for a norm of x (cfm.TILED_WIDE_NORMED) against the shipped ones, in one lease
# (~7 minutes after the installs): bash benchmarks/device/start.sh tiles 540
# Run AL (H200) measured its kernels 3.6 ms a call faster (q/k/v with norm1 and the feed-forward's first product;
# tiles of 32 columns lost 3.1 ms and are gone). Left before it becomes the rule: the GPU tests of
# tests/test_tiled_products.py at each width, probe_kernels --part s3gen again (kernel µs, S3Gen.batch's span),
# then a stream's first audio and text -> wav of 10 s as shipped and wide (a sitecustomize.py on PYTHONPATH sets
# the switch), alternating twice. Lines go to ~/res/{kernels,first_audio,e2e}_tiles.jsonl.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
echo "== commit $BENCH_COMMIT"
echo "== GPU tests at $(date +%T)"
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_tiled_products.py -k "not on_the_cpu" 2>&1 | tail -5
echo "== probe_kernels at $(date +%T)"
timeout 300 python3 benchmarks/probe_kernels.py --part s3gen --systems ours,ours-wide-normed,ours,ours-wide-normed \
    --out ~/res/kernels_tiles.jsonl 2>&1 | grep -v '^{' | grep 'S3Gen.batch'
wide=/tmp/tiles-wide
mkdir -p $wide
echo "from mlx_chatterbox.models import cfm; cfm.TILED_WIDE_NORMED = True" > $wide/sitecustomize.py
for way in shipped wide shipped wide; do
  echo "== $way at $(date +%T)"
  path=$([ $way = wide ] && echo $wide: || echo "")
  PYTHONPATH=$path$PYTHONPATH timeout 200 python3 benchmarks/probe_first_audio.py --modes stream \
      --out ~/res/first_audio_tiles.jsonl 2>&1 | grep -v '^{' | tail -2
  PYTHONPATH=$path$PYTHONPATH timeout 300 python3 benchmarks/bench_e2e.py --built full --cfm-dtype bfloat16 \
      --out ~/res/e2e_tiles.jsonl 2>&1 | grep -v '^{' | tail -1
done
echo "== done"
