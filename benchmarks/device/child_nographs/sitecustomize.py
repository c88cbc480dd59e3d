"""Put first on a process's path (serve.sh: SERVE_PATH=benchmarks/device/child_nographs): the processes that
multiprocessing spawns from it (``serve --vocoding process``: the vocoding process) run MLX-CUDA without CUDA
graphs, and the parent keeps them. MLX reads MLX_USE_CUDA_GRAPHS once, at its first graph, so this must be set
before the child's first GPU work; a spawned child starts with ``--multiprocessing-fork`` among its arguments.
ADR 6 "Open: CUDA graphs and S3Gen": S3Gen's first stream decode was faster without graphs, T3 slower."""

import os
import sys

if "--multiprocessing-fork" in sys.argv:
    os.environ["MLX_USE_CUDA_GRAPHS"] = "0"
