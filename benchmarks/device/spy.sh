#!/usr/bin/env bash
# probe_host.py under py-spy's native sampler (install.sh c puts py-spy in /tmp/site/bin), then its summary:
#   bash benchmarks/device/spy.sh LABEL [probe_host.py arguments...]
# The raw samples stay in ~/res/spy_LABEL.txt; both JSON lines go to ~/res/host.jsonl.
set -uo pipefail
label=$1
shift
/tmp/site/bin/py-spy record --native -r 200 -f raw -o ~/res/spy_"$label".txt -- \
  python3 benchmarks/probe_host.py --out ~/res/host.jsonl "$@"
python3 benchmarks/probe_host.py --summarize ~/res/spy_"$label".txt --label "$label" --out ~/res/host.jsonl
