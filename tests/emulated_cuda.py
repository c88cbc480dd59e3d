"""``mx.fast.cuda_kernel`` on the CPU, for the tests of our CUDA kernels where there is no GPU (CI, a Mac).

Each call's source, put together as MLX puts it (the template constants, then the source, inside a function of
the named inputs and outputs), is compiled with a C++20 compiler (``$CXX``, default g++) together with
emulated_cuda.h, and run on the call's inputs: every thread of a block a std::thread, the blocks one after the
other, ``__syncthreads`` a barrier, the warp's ``mma.sync`` and ``__shfl_xor_sync`` traded between the warp's
threads. What this checks is the source's logic (indexing, barriers, the fragment layouts of the PTX ISA), not
the GPU's timing, its memory model or its compiler. bfloat16 inputs and outputs, blocks of 128 threads.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

HEADER = Path(__file__).with_name("emulated_cuda.h")
_BUILD = Path(tempfile.gettempdir()) / "mlx_chatterbox_emulated_cuda"

# The one inline PTX instruction the emulation knows, with its operands: four "+f" sums, then six "r" words.
_MMA = re.compile(
    r'asm volatile\(\s*"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32 .*?\);', re.S
)


def _translate(source: str) -> str:
    """The source with each mma.sync asm statement made a call of the header's warp-level ``mma_emul``."""

    def call(match: re.Match) -> str:
        block = match.group(0)
        sums, words = re.findall(r'"\+f"\(([^()]*)\)', block), re.findall(r'"r"\(([^()]*)\)', block)
        if len(sums) != 4 or len(words) != 6:
            raise ValueError(f"an mma.sync with {len(sums)} sums and {len(words)} words: {block}")
        return f"mma_emul({', '.join(sums + words)});"

    translated = _MMA.sub(call, source)
    if "asm" in translated:
        raise ValueError("the source holds inline PTX that the emulation does not know")
    return translated


def _program(input_names: list[str], source: str, template: list[tuple]) -> str:
    constants = []
    for name, value in template:
        if isinstance(value, bool):
            constants.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            constants.append(f"  constexpr int {name} = {value};")
        elif value == mx.bfloat16:
            constants.append(f"  using {name} = bf16;")
        else:
            raise NotImplementedError(f"template {name}={value}: the emulation takes bfloat16 and integers")
    params = ", ".join(f"const bf16* {n}" for n in input_names)
    shapes = "".join(f"int {n}_shape[8];\n" for n in input_names)
    count = len(input_names)
    pointers = ", ".join(f"inputs[{i}].data()" for i in range(count))
    return f"""#include "{HEADER}"
{shapes}
void kernel({params}, bf16* out) {{
{chr(10).join(constants)}
{_translate(source)}
}}

// argv: blocks in x and y, then per input a file (int32 ndim, int32 shape..., bf16 values), the output's size
// and its file.
int main(int argc, char** argv) {{
  const int gx = atoi(argv[1]), gy = atoi(argv[2]);
  std::vector<std::vector<bf16>> inputs({count});
  int* shapes[] = {{{", ".join(f"{n}_shape" for n in input_names)}}};
  for (int i = 0; i < {count}; ++i) {{
    FILE* f = fopen(argv[3 + i], "rb");
    int ndim = 0;
    long size = 1;
    if (fread(&ndim, 4, 1, f) != 1) return 2;
    for (int d = 0; d < ndim; ++d) {{
      if (fread(&shapes[i][d], 4, 1, f) != 1) return 2;
      size *= shapes[i][d];
    }}
    inputs[i].resize(size);
    if (fread(inputs[i].data(), 2, size, f) != (size_t)size) return 2;
    fclose(f);
  }}
  const long out_size = atol(argv[3 + {count}]);
  std::vector<bf16> out(out_size);
  for (auto& v : out) v.bits = 0x7fc1;  // NaN: an output never written shows
  std::barrier<> block(128), warp0(32), warp1(32), warp2(32), warp3(32);
  block_barrier = &block;
  warp_barriers[0] = &warp0, warp_barriers[1] = &warp1, warp_barriers[2] = &warp2, warp_barriers[3] = &warp3;
  std::vector<std::thread> threads;
  for (int tid = 0; tid < 128; ++tid)
    threads.emplace_back([&, tid] {{
      threadIdx.x = tid;
      for (int by = 0; by < gy; ++by)
        for (int bx = 0; bx < gx; ++bx) {{
          blockIdx.x = bx, blockIdx.y = by;
          kernel({pointers}, out.data());
          block.arrive_and_wait();  // the next block's shared arrays are this one's
        }}
    }});
  for (auto& t : threads) t.join();
  FILE* f = fopen(argv[4 + {count}], "wb");
  fwrite(out.data(), 2, out_size, f);
  fclose(f);
  return 0;
}}
"""


def _bits(a: mx.array) -> np.ndarray:
    if a.dtype != mx.bfloat16:
        raise NotImplementedError(f"a {a.dtype} input: the emulation takes bfloat16")
    return np.asarray(mx.contiguous(a).view(mx.uint16)).ravel()


def cuda_kernel(name: str, input_names: list[str], output_names: list[str], source: str, header: str = ""):
    """Stands in for ``mx.fast.cuda_kernel``: the returned function compiles (once per program) and runs."""
    if header or len(output_names) != 1:
        raise NotImplementedError("the emulation takes one output and no header")

    def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        if (
            tuple(threadgroup) != (128, 1, 1)
            or grid[0] % 128
            or grid[2] != 1
            or output_dtypes[0] != mx.bfloat16
        ):
            raise NotImplementedError("the emulation runs blocks of 128 threads on a 2-D grid, bf16 out")
        program = _program(input_names, source, template)
        digest = hashlib.sha1((program + HEADER.read_text()).encode()).hexdigest()[:16]
        exe = _BUILD / f"{name}_{digest}"
        _BUILD.mkdir(exist_ok=True)
        if not exe.exists():
            exe.with_suffix(".cpp").write_text(program)
            compiler = os.environ.get("CXX", "g++")
            built = subprocess.run(
                [
                    compiler,
                    "-std=c++20",
                    "-O2",
                    "-pthread",
                    "-w",
                    str(exe.with_suffix(".cpp")),
                    "-o",
                    str(exe),
                ],
                capture_output=True,
                text=True,
            )
            if built.returncode:
                raise RuntimeError(f"{compiler} failed on {name}:\n{built.stderr[-4000:]}")
        with tempfile.TemporaryDirectory() as folder:
            files = []
            for i, a in enumerate(inputs):
                path = f"{folder}/in{i}"
                with open(path, "wb") as f:
                    np.array([a.ndim, *a.shape], np.int32).tofile(f)
                    _bits(a).tofile(f)
                files.append(path)
            size = int(np.prod(output_shapes[0]))
            argv = [str(exe), str(grid[0] // 128), str(grid[1]), *files, str(size), f"{folder}/out"]
            subprocess.run(argv, check=True)
            bits = np.fromfile(f"{folder}/out", np.uint16).reshape(output_shapes[0])
        return [mx.array(bits).view(mx.bfloat16)]

    return run
