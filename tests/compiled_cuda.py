"""Our CUDA kernels built for a GPU where there is none: nvcc (``$CUDA_HOME/bin/nvcc``, else
``/usr/local/cuda/bin/nvcc``) compiles each source MLX would build, for sm_90a (Hopper), and ptxas says what a
thread and a block take. The emulation (tests/emulated_cuda.py) checks a source's logic with g++; this checks
what only CUDA's compiler can: the inline PTX's operands, registers, spills and static shared memory. The
wrapper stands in for MLX's (a kernel of the named inputs, each with its shape, and outputs; the template
constants declared first), which NVRTC compiles with the same front end.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

_NVCC = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
NVCC = _NVCC if _NVCC.is_file() else None
_BUILD = Path(tempfile.gettempdir()) / "mlx_chatterbox_compiled_cuda"
_TYPES = {
    mx.float32: "float",
    mx.bfloat16: "__nv_bfloat16",
    mx.float16: "__half",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.bool_: "bool",
}
STATIC_SHARED_LIMIT = 48 * 1024  # bytes of static shared memory a block may declare


@dataclass(frozen=True)
class Program:
    """One kernel as MLX would build it: its source, names and the types and constants of one launch."""

    name: str
    source: str
    header: str
    inputs: tuple[tuple[str, mx.Dtype], ...]
    outputs: tuple[tuple[str, mx.Dtype], ...]
    template: tuple[tuple[str, object], ...]


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_bytes: int  # stores and loads
    shared_bytes: int


def record(monkeypatch) -> set[Program]:
    """``mx.fast.cuda_kernel`` replaced by a recorder: each launch's program goes into the set returned, and its
    outputs are zeros (the callers' shapes, not their values, are what the recording needs)."""
    programs: set[Program] = set()

    def kernel(name, input_names, output_names, source, header="", **options):
        def launch(inputs, output_shapes, output_dtypes, template=(), **call):
            ins = tuple(zip(input_names, (a.dtype for a in inputs)))
            outs = tuple(zip(output_names, output_dtypes))
            programs.add(Program(name, source, header, ins, outs, tuple(template)))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return launch

    monkeypatch.setattr(mx.fast, "cuda_kernel", kernel, raising=False)
    return programs


def _constant(name: str, value: object) -> str:
    if isinstance(value, bool):
        return f"  constexpr bool {name} = {'true' if value else 'false'};"
    if isinstance(value, int):
        return f"  constexpr int {name} = {value};"
    return f"  using {name} = {_TYPES[value]};"


def resources(program: Program) -> Resources:
    """Compile ``program`` with nvcc for sm_90a and read ptxas's report; a failed build raises with its log."""
    params = [
        f"const {_TYPES[d]}* __restrict__ {n}, const int* {n}_shape, int {n}_ndim" for n, d in program.inputs
    ]
    params += [f"{_TYPES[d]}* __restrict__ {n}" for n, d in program.outputs]
    text = "\n".join(
        [
            "#include <cuda_bf16.h>",
            "#include <cuda_fp16.h>",
            "#include <cstdint>",
            program.header,
            f"extern \"C\" __global__ void {program.name}({', '.join(params)}) {{",
            *(_constant(k, v) for k, v in program.template),
            program.source,
            "}",
        ]
    )
    digest = hashlib.sha1(text.encode()).hexdigest()[:16]
    _BUILD.mkdir(exist_ok=True)
    source, log = _BUILD / f"{program.name}_{digest}.cu", _BUILD / f"{program.name}_{digest}.log"
    if not log.exists():
        source.write_text(text)
        cmd = [str(NVCC), "-arch=sm_90a", "-cubin", "-O3", "-std=c++17", "-Xptxas", "-v"]
        built = subprocess.run(
            [*cmd, "-o", str(source.with_suffix(".cubin")), str(source)], capture_output=True, text=True
        )
        if built.returncode:
            raise RuntimeError(f"nvcc failed on {program.name} {program.template}:\n{built.stderr[-4000:]}")
        log.write_text(built.stderr)
    report = log.read_text()
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    shared = re.search(r"(\d+) bytes smem", report)
    return Resources(
        int(registers.group(1)),
        int(spills.group(1)) + int(spills.group(2)) if spills else 0,
        int(shared.group(1)) if shared else 0,
    )
