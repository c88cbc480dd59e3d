#!/usr/bin/env bash
# Several jobs of one device session, one after the other, each argument a command line whose output goes to
# ~/res/stepN.log (so that the "== done" of serve.sh or decode.sh in it is not this job's):
#   bash benchmarks/device/start.sh steps 540 'bash benchmarks/device/serve.sh english "" "--concurrency 8"' \
#       'python3 benchmarks/probe_s3gen.py --out ~/res/s3gen_probe.jsonl'
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
echo "== commit $BENCH_COMMIT"
i=0
for command in "$@"; do
  i=$((i + 1))
  echo "== step $i at $(date +%T): $command"
  bash -c "$command" > ~/res/step$i.log 2>&1
  echo "== step $i ended with $? at $(date +%T)"
done
echo "== done"
