#!/usr/bin/env bash
# Does the host core a thread runs on set a lone stream's first audio? (Run AY: the same first decode took
# 85-90 ms in some modes and 112-145 in others, five runs alike within a mode, T3's steps before it slow with it:
# host-bound work 1.4x slower by the thread, not by the mode.) ~5 minutes: bash benchmarks/device/start.sh cpu 560
# 1. The host: lscpu, the GPU's CPU affinity and NUMA node, and a pure-Python loop's time on each logical CPU
#    (twice: a slow CPU that stays slow is the machine's, not the moment's).
# 2. probe_first_audio's stream and stream-thread modes unpinned, then pinned (taskset) to the 4 fastest CPUs of
#    the loop, then to the 4 slowest, then to the GPU's NUMA node's CPUs.
export PYTHONPATH=/tmp/site:. MLX_PTX_CACHE_DIR=~/ptx PYTHONUNBUFFERED=1
here=$(dirname "$0")
echo "== commit $BENCH_COMMIT"
lscpu | grep -e 'Model name' -e 'Thread(s) per core' -e 'Core(s) per socket' -e 'Socket(s)' -e 'NUMA' -e MHz
nvidia-smi topo -m 2>&1 | head -4
loop='import time
t = time.perf_counter(); s = 0
for i in range(3_000_000): s += i
print(round(1e3 * (time.perf_counter() - t), 1))'
for round in 1 2; do
  for c in $(seq 0 $(($(nproc) - 1))); do echo "$c $(taskset -c "$c" python3 -c "$loop")"; done > ~/res/cpu_loop_$round.txt
  echo "loop ms by CPU, round $round: $(tr '\n' ' ' < ~/res/cpu_loop_$round.txt)"
done
sorted=$(paste ~/res/cpu_loop_1.txt ~/res/cpu_loop_2.txt | awk '{print $1, $2 + $4}' | sort -k2,2n | cut -d' ' -f1)
fast=$(echo "$sorted" | head -4 | paste -sd,)
slow=$(echo "$sorted" | tail -4 | paste -sd,)
node=$(lscpu -p=CPU,NODE | grep -v '^#' | awk -F, '$2 == 0 {print $1}' | paste -sd,)
probe() {  # label, taskset's CPU list or "all"
  echo "== $1 (CPUs $2) at $(date +%T)"
  local pin=()
  [ "$2" = all ] || pin=(taskset -c "$2")
  timeout 200 "${pin[@]}" python3 benchmarks/probe_first_audio.py --model /tmp/serve-english/mlx \
      --voice /tmp/serve-english/voice.safetensors --cfm-dtype bfloat16 --tokens 250 --repeats 5 \
      --modes stream,stream-thread,worker-inline,stream --out ~/res/cpu_$1.jsonl 2>&1 | grep -e '^| [sw]' -e Error
}
bash "$here/model.sh" english
probe unpinned all
probe fast "$fast"
probe slow "$slow"
probe node0 "$node"
probe unpinned2 all
echo "== done"
