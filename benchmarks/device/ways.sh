#!/usr/bin/env bash
# Sourced by the jobs that serve or run one library in several ways (kernel.sh, sixteen.sh): a way is a folder
# whose sitecustomize.py sets a library switch in every process it starts (the server's vocoding process too);
# shipped is the library as it is, no folder; cudnn (made here) turns HiFT's convolution kernel off (MLX's cuDNN
# convolutions, the library's way on CUDA before run AT).
ways=/tmp/ways
way() {  # name, the sitecustomize.py's source
  mkdir -p $ways/$1
  printf '%s\n' "$2" > $ways/$1/sitecustomize.py
}
path() {  # a way's sitecustomize folder (none for shipped)
  [ "$1" = shipped ] || echo $ways/$1
}
way cudnn 'from mlx_chatterbox.models import layers

layers.KERNEL_CONVS = False'
many() {  # name, way: served Turbo, 16 streams at a time (run AR's scenario)
  echo "== served turbo, 16 at a time, $2 at $(date +%T)"
  SERVE_PATH=$(path $2) bash "$(dirname "${BASH_SOURCE[0]}")/named.sh" $1 turbo \
      "--first-chunk 15 --cfm-dtype bfloat16" \
      "--concurrency 16 --requests 48 --tokens 250 --tokens-spread 100 --formats streamed"
}
