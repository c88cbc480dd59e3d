#!/usr/bin/env bash
# The CUDA decode paths' tests (tests/test_decode_cuda.py; ~4 min on a fresh machine, most of it compiling the
# kernels), then single-stream decode speed for every model (benchmarks/probe_step.py) into ~/res/step.jsonl.
# Extra arguments go to probe_step.py (e.g. --systems ours-slice-update,ours,upstream
# --upstream-src DIR).
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
echo "== commit $BENCH_COMMIT"
# DECODE_TESTS (a pytest -k expression) runs only those tests; never the CPU runs of the kernels' sources (CI's).
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_decode_cuda.py \
    -k "(${DECODE_TESTS:-not nothing}) and not on_the_cpu" 2>&1 | tail -8
timeout 500 python3 benchmarks/probe_step.py --part step,split --tokens 200 --repeats 2 --systems mlx-ops,ours \
    --models english,turbo,nano --dtypes float32,bfloat16 --out ~/res/step.jsonl "$@" 2>&1 | grep -v '^{'
echo "== done"
