#!/usr/bin/env bash
# Issue 25's side by side with upstream on the GPU: text -> wav of 10 s, ours and upstream's ChatterboxTTS on the
# machine's CUDA torch, each in its own process (GPU peak, time): bash benchmarks/device/start.sh upstream 500
# Needs upstream's packages in /tmp/site first: `install.sh a` says which the image lacks, and `install.sh e`,
# `h` (resemble-perth) and the others install them from the wheels `wheels.sh upstream` makes (run AM's attempt
# failed for want of them; run AO's image needed e and h; there text -> wav took 0.95 s against
# upstream's 5.97). compare.py first writes the random checkpoint with upstream's modules (~1 minute).
# Lines go to ~/res/compare.jsonl; compare.py's log, each job's stderr in it, to ~/res/upstream.log.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
echo "== commit $BENCH_COMMIT"
python3 -c "import chatterbox.tts, perth, librosa; print('upstream imports: ok')" 2>&1 | tail -3
echo "== compare at $(date +%T)"
timeout 900 python3 benchmarks/compare.py --preset gpu --skip t3,s3gen --out ~/res/compare.jsonl 2>&1
# Issue 25's peak-memory goal on the same checkpoint and voice: run AV had ours at 4,403 MiB against upstream's
# 3,647 with MLX's CUDA graphs of 100 kernels, S3Gen's budget of 1 GiB and T3's prefill unbounded; the package
# has graphs of 20, a lone request's budget of 256 MiB and a prefill bound of 192 MiB a row (runs BA and BC; run
# BD: 3,610 MiB). Ours without the prefill bound, then as it was (~40 s each).
echo "== ours without T3's prefill bound at $(date +%T)"
timeout 300 python3 benchmarks/bench_e2e.py --systems ours --prefill-budget none --out ~/res/compare_budget.jsonl \
    2>&1 | grep -v '^{' | tail -2
echo "== ours with MLX's graphs of 100 kernels, S3Gen's budget of 1 GiB, no prefill bound at $(date +%T)"
MLX_MAX_OPS_PER_BUFFER=100 timeout 300 python3 benchmarks/bench_e2e.py --systems ours --memory-budget 1024 \
    --prefill-budget none --out ~/res/compare_budget.jsonl 2>&1 | grep -v '^{' | tail -2
echo "== done"
