"""``mx.fast.cuda_kernel`` on the CPU, for the tests of our CUDA kernels where there is no GPU (CI, a Mac).

Each call's source, put together as MLX puts it (the header, then a function of the named inputs and outputs
that declares the template constants and holds the source), is compiled with a C++20 compiler (``$CXX``,
default g++) together with emulated_cuda.h, and run on the call's inputs: every thread of a block a
std::thread, the blocks one after the other, ``__syncthreads`` a barrier, the warp's ``mma.sync`` and shuffles
traded between the warp's threads, the dynamic shared memory a static array of the call's size. What this
checks is the source's logic (indexing, barriers, reductions, the fragment layouts of the PTX ISA), not the
GPU's timing, its memory model or its compiler. Arrays of float32, bfloat16, int32, uint32 and bool.
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
_TYPES = {
    mx.float32: "float",
    mx.bfloat16: "bf16",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.bool_: "bool",
}
_NUMPY = {
    mx.float32: np.float32,
    mx.bfloat16: np.uint16,
    mx.int32: np.int32,
    mx.uint32: np.uint32,
    mx.bool_: np.bool_,
}

# CUDA kernels read a 16-byte load's registers as their 8 half-precision values through a pointer (as CUDA's
# own headers do, and NVRTC compiles as meant); g++'s strict aliasing at -O2 may drop the load behind such a
# read (the tiled kernel's row statistics read zeros).
_FLAGS = ["-std=c++20", "-O2", "-fno-strict-aliasing", "-pthread", "-w"]

# The one inline PTX instruction the emulation knows, with its operands: four "+f" sums, then six "r" words.
_MMA = re.compile(
    r'asm volatile\(\s*"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32 .*?\);', re.S
)
_DYNAMIC = re.compile(r"extern __shared__ ([\w ]+?) (\w+)\[\];")


def _translate(source: str, shared_bytes: int) -> str:
    """The source with each mma.sync statement a call of the header's ``mma_emul``, and its dynamic shared
    array a static one of the call's size."""

    def mma(match: re.Match) -> str:
        block = match.group(0)
        sums, words = re.findall(r'"\+f"\(([^()]*)\)', block), re.findall(r'"r"\(([^()]*)\)', block)
        if len(sums) != 4 or len(words) != 6:
            raise ValueError(f"an mma.sync with {len(sums)} sums and {len(words)} words: {block}")
        return f"mma_emul({', '.join(sums + words)});"

    def dynamic(match: re.Match) -> str:
        kind, name = match.group(1), match.group(2)
        return f"static {kind} {name}[{shared_bytes} / sizeof({kind}) + 1] __attribute__((aligned(16)));"

    translated = _DYNAMIC.sub(dynamic, _MMA.sub(mma, source))
    if re.search(r"\basm\b", translated):
        raise ValueError("the source holds inline PTX that the emulation does not know")
    return translated


def _type(dtype: mx.Dtype) -> str:
    if dtype not in _TYPES:
        raise NotImplementedError(f"{dtype}: the emulation takes {', '.join(map(str, _TYPES))}")
    return _TYPES[dtype]


def _program(header, source, input_names, inputs, output_names, output_dtypes, template, shared_bytes) -> str:
    constants = []
    for name, value in template:
        if isinstance(value, bool):
            constants.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            constants.append(f"  constexpr int {name} = {value};")
        else:
            constants.append(f"  using {name} = {_type(value)};")
    params = [f"const {_type(a.dtype)}* {n}" for n, a in zip(input_names, inputs)]
    params += [f"{_type(d)}* {n}" for n, d in zip(output_names, output_dtypes)]
    shapes = "".join(f"int {n}_shape[8], {n}_ndim;\n" for n in input_names)
    reads = "".join(
        f"  auto in{i} = read_input(argv[4 + {i}], {n}_shape, &{n}_ndim, sizeof({_type(a.dtype)}));\n"
        for i, (n, a) in enumerate(zip(input_names, inputs))
    )
    n_in = len(inputs)
    outs = "".join(  # bytes, set to 0xff: an output never written shows (NaN, -1)
        f"  std::vector<char> out{j}(atol(argv[4 + {n_in} + 2 * {j}]) * sizeof({_type(d)}), char(0xff));\n"
        for j, d in enumerate(output_dtypes)
    )
    writes = "".join(
        f'  {{ FILE* f = fopen(argv[5 + {n_in} + 2 * {j}], "wb"); fwrite(out{j}.data(), 1, out{j}.size(), f);'
        " fclose(f); }\n"
        for j in range(len(output_dtypes))
    )
    args = [f"reinterpret_cast<const {_type(a.dtype)}*>(in{i}.data())" for i, a in enumerate(inputs)]
    args += [f"reinterpret_cast<{_type(d)}*>(out{j}.data())" for j, d in enumerate(output_dtypes)]
    return f"""#include "{HEADER}"
{header}
{shapes}
void kernel({", ".join(params)}) {{
{chr(10).join(constants)}
{_translate(source, shared_bytes)}
}}

// argv: blocks in x and y, threads a block, an input file each (int32 ndim, int32 shape..., the values), then
// each output's size and file.
int main(int argc, char** argv) {{
{reads}{outs}  launch(atoi(argv[1]), atoi(argv[2]), atoi(argv[3]), [&] {{ kernel({", ".join(args)}); }});
{writes}  return 0;
}}
"""


def cuda_kernel(
    name: str,
    input_names: list[str],
    output_names: list[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    shared_memory: int = 0,
):
    """Stands in for ``mx.fast.cuda_kernel``: the returned function compiles (once per program) and runs."""
    if not ensure_row_contiguous:
        raise NotImplementedError("the emulation reads its inputs row-contiguous")

    def run(
        inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None, verbose=False
    ):
        block = threadgroup[0]
        if (
            threadgroup[1:] != (1, 1)
            or grid[0] % block
            or grid[2] != 1
            or block % 32
            or init_value is not None
        ):
            raise NotImplementedError(
                "the emulation runs 1-D blocks of whole warps on a 2-D grid, no init_value"
            )
        for name, a in zip(input_names, inputs):
            if a.ndim == 0 and re.search(rf"\b{name}_(shape|strides|ndim)\b", source):
                # MLX's kernel then has no such parameter, though it still passes one: a silent misread.
                raise ValueError(f"{name} is 0-d, but the source reads its shape, strides or ndim")
        program = _program(
            header, source, input_names, inputs, output_names, output_dtypes, template, shared_memory
        )
        digest = hashlib.sha1((program + HEADER.read_text() + " ".join(_FLAGS)).encode()).hexdigest()[:16]
        exe = _BUILD / f"{name}_{digest}"
        _BUILD.mkdir(exist_ok=True)
        if not exe.exists():
            exe.with_suffix(".cpp").write_text(program)
            compiler = os.environ.get("CXX", "g++")
            built = subprocess.run(
                [compiler, *_FLAGS, str(exe.with_suffix(".cpp")), "-o", str(exe)],
                capture_output=True,
                text=True,
            )
            if built.returncode:
                raise RuntimeError(f"{compiler} failed on {name}:\n{built.stderr[-4000:]}")
        with tempfile.TemporaryDirectory() as folder:
            argv = [str(exe), str(grid[0] // block), str(grid[1]), str(block)]
            for i, a in enumerate(inputs):
                path = f"{folder}/in{i}"
                with open(path, "wb") as f:
                    np.array([a.ndim, *a.shape], np.int32).tofile(f)
                    values = mx.contiguous(a).view(mx.uint16) if a.dtype == mx.bfloat16 else a
                    np.asarray(values).astype(_NUMPY[a.dtype], copy=False).tofile(f)
                argv.append(path)
            for j, shape in enumerate(output_shapes):
                argv += [str(int(np.prod(shape))), f"{folder}/out{j}"]
            subprocess.run(argv, check=True)
            outs = []
            for j, (shape, dtype) in enumerate(zip(output_shapes, output_dtypes)):
                values = np.fromfile(f"{folder}/out{j}", _NUMPY[dtype]).reshape(shape)
                outs.append(mx.array(values).view(mx.bfloat16) if dtype == mx.bfloat16 else mx.array(values))
        return outs

    return run
