#!/usr/bin/env bash
# Issue 25's memory goal, T3's prefill ways beside upstream (~8 minutes after the installs, upstream's wheels
# included: install.sh e, h): bash benchmarks/device/start.sh prefill 560
# Run BB: text -> wav of 10 s peaked in T3's prefill, 3,649 MiB against upstream's 3,647 (S3Gen 3,547). compare.py
# writes its checkpoint and runs both systems as shipped; then ours alone on that checkpoint and cloned voice,
# each way of bench_e2e --prefill-way in its own process, alternated (the host's speed moves, run AZ): the
# prefill under a memory bound of N MiB a row, or its cache padded by the first decode step (late-pad). Each
# line carries the stage peaks and T3's first token (ms from the text), the latency a bound would cost.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
echo "== commit $BENCH_COMMIT"
python3 -c "import chatterbox.tts, perth, librosa; print('upstream imports: ok')" 2>&1 | tail -3
echo "== compare at $(date +%T)"
timeout 300 python3 benchmarks/compare.py --preset gpu --skip t3,s3gen --out ~/res/compare.jsonl 2>&1 |
    grep -e '^upstream ' -e '^ours ' -e 'peak MiB by stage'
for way in shipped bound:128 late-pad bound:192 bound:96 late-pad bound:128 shipped; do
  echo "== ours, prefill $way at $(date +%T)"
  timeout 120 python3 benchmarks/bench_e2e.py --systems ours --prefill-way "$way" --out ~/res/prefill.jsonl 2>&1 |
      grep -v '^{' | tail -2
done
echo "== done"
