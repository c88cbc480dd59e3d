#!/usr/bin/env bash
# Not a job: serve.sh for the jobs that start several servers, each kept under NAME: its output in
# ~/res/NAME.log, its lines in ~/res/NAME.jsonl, the server's log in ~/res/NAME_server.log; then each
# scenario's row and its Server-Timing medians:
#   bash named.sh NAME VARIANT FLAGS SCENARIO...   (SERVE_PATH and the like pass through the environment)
set -uo pipefail
name=$1
shift
bash "$(dirname "$0")/serve.sh" "$@" > ~/res/"$name".log 2>&1
mv ~/res/serve.jsonl ~/res/"$name".jsonl
cp ~/res/serve_server.log ~/res/"$name"_server.log
grep '^| closed' ~/res/"$name".log
