#!/usr/bin/env bash
# The worker's first-audio hold (worker.FIRST_AUDIO_LEAD_S) against no hold, in one lease (~9 minutes after the
# installs): bash benchmarks/device/start.sh hold 560
# In-process first (probe_first_audio: TTS.stream, the Worker with its vocoding thread and with its process),
# English and Turbo (issue 25's 0.12 s for Turbo: how far its in-process floor is), with and without
# --no-hold; then served, one stream at a time, English (bf16 estimator) and Turbo, each with the hold and
# without it (a sitecustomize.py on SERVE_PATH sets FIRST_AUDIO_LEAD_S = None in the server); then
# 16 English streams at a time each way, where the hold should not come into play. Each served run's lines go to
# ~/res/serve_<variant>_<hold|nohold>[_16].jsonl, its output to a log of the same name.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
nohold=/tmp/nohold
mkdir -p $nohold
echo "from mlx_chatterbox.server import worker; worker.FIRST_AUDIO_LEAD_S = None" > $nohold/sitecustomize.py
# Each variant in the estimator dtype it is served in below, and Turbo in bf16 too (our tiled products).
for pair in english:bfloat16 turbo:float32 turbo:bfloat16; do
  variant=${pair%:*} dtype=${pair#*:}
  bash "$here/model.sh" $variant
  model=/tmp/serve-$variant
  for hold in "" --no-hold; do
    echo "== probe_first_audio $variant $dtype $hold"
    timeout 300 python3 benchmarks/probe_first_audio.py --model $model/mlx --voice $model/voice.safetensors \
        --cfm-dtype $dtype --modes stream,worker-thread,worker-process $hold --out ~/res/first_audio.jsonl 2>&1 \
        | grep -v '^{'
  done
done
served() {  # name, SERVE_PATH, variant, server flags, scenario; serve.sh's own "== done" stays in its log
  echo "== $1 at $(date +%T)"
  SERVE_PATH=$2 bash "$here/serve.sh" "$3" "$4" "$5" > ~/res/"$1".log 2>&1
  mv ~/res/serve.jsonl ~/res/"$1".jsonl
  grep '^| closed' ~/res/"$1".log | head -1
}
one="--concurrency 1 --requests 6 --formats streamed"
for variant in english turbo; do
  flags="--warm-batches off --first-chunk 15"
  [ $variant = english ] && flags="$flags --cfm-dtype bfloat16"
  served serve_${variant}_hold "" $variant "$flags" "$one"
  served serve_${variant}_nohold $nohold $variant "$flags" "$one"
done
many="--concurrency 16 --requests 32 --formats streamed"
served serve_english_hold_16 "" english "--cfm-dtype bfloat16" "$many"
served serve_english_nohold_16 $nohold english "--cfm-dtype bfloat16" "$many"
echo "== done"
