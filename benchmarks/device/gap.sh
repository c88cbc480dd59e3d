#!/usr/bin/env bash
# Why a served stream's first decode takes 2-3x the probe's (issue 25), in one lease (~6 minutes after the
# installs): bash benchmarks/device/start.sh gap 450
# Run AN (H100, Turbo, bf16 estimator, first chunk 15): first chunk to first audio took 161 ms served against
# the 63 ms decode of probe_first_audio's worker-process, with the same shapes and voice (checked on the CPU)
# and T3's steps as fast; MLX's CUDA-graph cache ten times larger did not help (run AN), nor holding T3 (run AM).
# What still differs: the request's budget (bench_serve 250 tokens, the probe 100), the marking threads (serve:
# 4 on 16 cores, the probe 1), max_batch, and the server itself. So: the probe's worker-process at 100 and 250
# tokens, with 1 and 4 marking threads; then served requests at 100 and 250 tokens, and at 250 with one marking
# thread and with the fp32 estimator (served, its decodes took 175 ms a call against bf16's 203-205: the
# reverse of the probe's), each decode in the server's vocoding process timed there (a sitecustomize.py on
# SERVE_PATH) into ~/res/decodes_<server>.txt as "pid unix-time tokens final ms". Lines go to
# ~/res/first_audio_gap.jsonl and ~/res/gap_<server>.jsonl.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
dir=/tmp/serve-turbo
echo "== commit $BENCH_COMMIT"
bash "$here/model.sh" turbo
for tokens in 100 250; do
  for marking in 1 4; do
    echo "== probe: $tokens tokens, $marking marking threads at $(date +%T)"
    timeout 200 python3 benchmarks/probe_first_audio.py --model $dir/mlx --voice $dir/voice.safetensors \
        --modes worker-process --cfm-dtype bfloat16 --first-chunk 15 --tokens $tokens --mark-threads $marking \
        --max-batch 128 --repeats 5 --out ~/res/first_audio_gap.jsonl 2>&1 | grep '^| worker'
  done
done
timer=/tmp/gap-timer
mkdir -p $timer
cat > $timer/sitecustomize.py <<'PY'
import os
import time

from mlx_chatterbox.generation import stream

_decode = stream.StreamVocoder._decode


def timed(self):
    due, start = self._due, time.perf_counter()
    try:
        return _decode(self)
    finally:
        with open(os.path.expanduser("~/res/decodes.txt"), "a") as f:
            ms = 1e3 * (time.perf_counter() - start)
            f.write(f"{os.getpid()} {time.time():.3f} {due.tokens.shape[1]} {int(due.final)} {ms:.1f}\n")


stream.StreamVocoder._decode = timed
PY
served() {  # name, server flags besides these, scenarios...
  local name=$1 flags="--warm-batches off --first-chunk 15 -v $2"
  shift 2
  echo "== served, $name at $(date +%T)"
  SERVE_PATH=$timer bash "$here/named.sh" gap_$name turbo "$flags" "$@"
  mv ~/res/decodes.txt ~/res/decodes_$name.txt
  echo "first decodes in its vocoding process, in order (ms; the first request's builds its shapes):"
  awk '$3 == 15 && $4 == 0 {printf "%s; ", $5} END {print ""}' ~/res/decodes_$name.txt
}
one="--concurrency 1 --requests 8 --formats streamed"
served shipped "--cfm-dtype bfloat16" "$one --tokens 100" "$one --tokens 250"
served mark1 "--cfm-dtype bfloat16 --mark-threads 1" "$one --tokens 250"
served fp32 "" "$one --tokens 250"
echo "== done"
