#!/usr/bin/env bash
# Issue 25's memory goal, T3's prefill budgets beside upstream (~8 minutes after the installs, upstream's wheels
# included: install.sh e, h): bash benchmarks/device/start.sh prefill 560
# Run BC (tree 7bd83c8, the bound then a bench-side way): with S3Gen bounded, text -> wav of 10 s peaked in T3's
# prefill, 3,649-3,880 MiB against upstream's 3,647; at 192 MiB a row 3,589, T3's first token 0.9 ms later (the
# library's budget since). compare.py writes its checkpoint and runs both systems as shipped; then ours alone on
# that checkpoint and cloned voice, a prefill budget (bench_e2e --prefill-budget, MiB a row) a process,
# alternated (the host's speed moves, run AZ). Each line has the stage peaks and T3's first token (ms from the
# text), the latency a bound costs. (BB also padded the cache in the first decode step instead: no change.)
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
echo "== commit $BENCH_COMMIT"
python3 -c "import chatterbox.tts, perth, librosa; print('upstream imports: ok')" 2>&1 | tail -3
echo "== compare at $(date +%T)"
timeout 300 python3 benchmarks/compare.py --preset gpu --skip t3,s3gen --out ~/res/compare.jsonl 2>&1 |
    grep -e '^upstream ' -e '^ours ' -e 'peak MiB by stage'
for budget in none 128 192 96 none 128 192; do
  echo "== ours, prefill budget $budget at $(date +%T)"
  timeout 120 python3 benchmarks/bench_e2e.py --systems ours --prefill-budget "$budget" \
      --out ~/res/prefill.jsonl 2>&1 | grep -v '^{' | tail -2
done
echo "== done"
