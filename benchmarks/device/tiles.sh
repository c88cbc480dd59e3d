#!/usr/bin/env bash
# The tiled kernel's tile widths (cfm.TILED_NARROW_COLUMNS, cfm.TILED_WIDE_NORMED) against the shipped ones, in
# one lease (~8 minutes after the installs): bash benchmarks/device/start.sh tiles 540
# The GPU tests of tests/test_tiled_products.py (each width), then probe_kernels --part s3gen for each system
# (kernel µs, S3Gen.batch's span), then a stream's first audio and text -> wav of 10 s as shipped and with both
# switches on (a sitecustomize.py on PYTHONPATH sets them). Lines go to ~/res/{kernels,first_audio,e2e}_tiles.jsonl.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
echo "== commit $BENCH_COMMIT"
echo "== GPU tests at $(date +%T)"
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_tiled_products.py -k "not on_the_cpu" 2>&1 | tail -5
echo "== probe_kernels at $(date +%T)"
timeout 400 python3 benchmarks/probe_kernels.py --part s3gen \
    --systems ours,ours-narrow-columns,ours-wide-normed,ours-narrow-wide,ours --out ~/res/kernels_tiles.jsonl \
    2>&1 | grep -v '^{'
both=/tmp/tiles-both
mkdir -p $both
echo "from mlx_chatterbox.models import cfm; cfm.TILED_NARROW_COLUMNS = cfm.TILED_WIDE_NORMED = True" \
    > $both/sitecustomize.py
for way in shipped both shipped both; do
  echo "== $way at $(date +%T)"
  path=$([ $way = both ] && echo $both: || echo "")
  PYTHONPATH=$path$PYTHONPATH timeout 200 python3 benchmarks/probe_first_audio.py --modes stream \
      --out ~/res/first_audio_tiles.jsonl 2>&1 | grep -v '^{' | tail -2
  PYTHONPATH=$path$PYTHONPATH timeout 300 python3 benchmarks/bench_e2e.py --built full --cfm-dtype bfloat16 \
      --out ~/res/e2e_tiles.jsonl 2>&1 | grep -v '^{' | tail -2
done
echo "== done"
