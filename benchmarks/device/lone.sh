#!/usr/bin/env bash
# Where a lone English stream's first decode loses its time outside TTS.stream (issue 25: run AV's decode took
# 89 ms in TTS.stream, 152 on the Worker's vocoding thread, ~159 served through the vocoding process), then
# memory.sh (~12 minutes in all): bash benchmarks/device/start.sh lone 560
# 1. probe_first_audio on serve's random model and voice (bf16 estimator, 250 tokens, first chunk 15), every
#    mode in one process: TTS.stream, on a thread of its own, the Worker inline (T3 waits for the decode), with
#    its vocoding thread, with its vocoding process; S3Gen's "auto" memory budget, as shipped.
# 2. The same without S3Gen's memory bound (the bound is MLX's process-wide limit, and T3's work beside the
#    decode counts against it), and the Worker inline with a batch of 1 row.
# 3. memory.sh as it was then (the prefill bound, S3Gen's budgets, fp32 attention in pieces), in ~/res/memory.log.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
bash "$here/model.sh" english
probe() {  # label, probe_first_audio's arguments
  echo "== $1 at $(date +%T)"
  shift
  timeout 300 python3 benchmarks/probe_first_audio.py --model /tmp/serve-english/mlx \
      --voice /tmp/serve-english/voice.safetensors --cfm-dtype bfloat16 --tokens 250 --repeats 5 \
      --out ~/res/lone.jsonl "$@" 2>&1 | grep -e '^|' -e Error
}
probe "every mode, budget auto" --modes stream,stream-thread,worker-inline,worker-thread,worker-process,stream
probe "no memory bound" --memory-budget none --modes stream,worker-inline,worker-thread,worker-process
probe "inline, a batch of 1 row" --max-batch 1 --modes worker-inline,stream
echo "== memory.sh at $(date +%T)"
bash "$here/memory.sh" > ~/res/memory.log 2>&1
grep -v '^== done' ~/res/memory.log
echo "== done"
