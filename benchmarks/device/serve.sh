#!/usr/bin/env bash
# The real server under load (issue 24): a random full-size model of VARIANT (english or turbo) served with
# `serve --max-batch 128 --max-queue 256` plus SERVE_FLAGS, then bench_serve.py scenarios, one per remaining
# argument, into ~/res/serve.jsonl: bash serve.sh english "" "--concurrency 128 --formats whole --requests 128" ...
# SERVER_PID in a scenario becomes the server's process id (a soak's --pid, for its RSS). SERVE_PATH, when set, is
# put first on the path: a folder with a sitecustomize.py that sets a library switch or an environment variable
# serves an A/B in one lease (run AA1 so set MLX_USE_CUDA_GRAPHS=0 in the vocoding process, before it did so itself).
# SERVE_WRAP, when set, is put before the server's command: a sampler such as
#   SERVE_WRAP="/tmp/site/bin/py-spy record --native --subprocesses --threads -r 100 -f raw -o $HOME/res/spy_serve.txt --"
# (its samples are written when the server is stopped at the end; probe_host.py --summarize reads them).
export PYTHONPATH=${SERVE_PATH:+$SERVE_PATH:}/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
variant=$1 flags=$2
shift 2
echo "== commit $BENCH_COMMIT"
dir=/tmp/serve-$variant
bash "$(dirname "$0")/model.sh" "$variant"
# shellcheck disable=SC2086  # the flags and the wrap are words
${SERVE_WRAP:-} python3 -m mlx_chatterbox serve --model "$dir/mlx" --voice "$dir/voice.safetensors" --port 8000 \
    --max-batch 128 --max-queue 256 $flags > ~/res/serve_server.log 2>&1 &
server=$!
t0=$SECONDS
until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null; do
  sleep 1
  if ! kill -0 $server 2>/dev/null || [ $((SECONDS - t0)) -gt 600 ]; then
    echo "serve did not start"; tail -20 ~/res/serve_server.log; echo "== done"; exit 1
  fi
done
echo "== $variant $flags: up after $((SECONDS - t0)) s"
for scenario in "$@"; do
  scenario=${scenario//SERVER_PID/$server}
  echo "== $scenario"
  # shellcheck disable=SC2086
  timeout 900 python3 benchmarks/bench_serve.py --url http://127.0.0.1:8000 $scenario --out ~/res/serve.jsonl 2>&1 \
      | grep -v '^{'
done
# The device memory each process holds at the end: MLX's peak in the rows leaves out what cuDNN's graphs, cuFFT's
# plans and CUDA's own context take.
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv 2>/dev/null | sed 's/^/gpu memory: /'
kill -INT $server
wait $server
echo "== done"
