"""T3 speech-token generation speed: ours (MLX) against upstream PyTorch ``T3.inference`` and mlx-audio's
``T3.inference`` (a benchmark-only peer, benchmarks/peer_mlx_audio.py), in one run.

Full-size English T3 with random weights, CFG on (batch 2), EOS disabled so that every run decodes exactly
``--tokens`` tokens, upstream's default sampling knobs. One warm-up run is excluded; the median of
``--repeats`` runs is reported. See benchmarks/README.md for what each number means.

    python benchmarks/bench_t3.py --systems ours,upstream --tokens 300 --repeats 3 --dtype float32 \
        --device gpu --torch-device cuda --out benchmarks/out/t3.jsonl
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
# Import our package before mlx.core: it preloads OpenBLAS and keeps fp32 matmuls in fp32 (see _backend.py).
import mlx_chatterbox  # noqa: F401  isort: skip
from mlx_chatterbox import _backend  # isort: skip

import argparse
import random
import statistics
import time
import types
from collections.abc import Callable

import mlx.core as mx
from common import bare_upstream, machine_info, refuse_torch_cpu_beside_preload, write_line

from mlx_chatterbox.models.t3 import T3, T3Config
from mlx_chatterbox.quantize import quantize_t3, t3_weight_bytes

TEXT_LEN = 40  # text ids between SOT and EOT
PROMPT_LEN = 150  # T3 conditioning prompt tokens, as a built-in voice
BATCH = 2  # CFG: conditional + unconditional rows
COND_LEN = 1 + 32 + 1  # speaker embedding + Perceiver queries + emotion
PREFILL_LEN = COND_LEN + (TEXT_LEN + 2) + 2  # + SOT/EOT + the double start-of-speech (architecture §3.5)
KNOBS = dict(temperature=0.8, min_p=0.05, top_p=1.0, repetition_penalty=1.2, cfg_weight=0.5)
EXAGGERATION = 0.5
# Both systems run the same full-size English T3 (Llama-520M); its sizes and ids come from our config.
CFG = T3Config()
SYSTEMS = ("ours", "upstream", "mlx-audio")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# --dtype names for ours -> (activation/KV dtype, transform applied to our T3 after set_dtype, or None).
# Upstream and mlx-audio run the float dtypes only.
OUR_DTYPES: dict[str, tuple[str, Callable[[T3], T3] | None]] = {name: (name, None) for name in FLOAT_DTYPES}
# 8- and 4-bit backbone linears with bf16 scales, as `convert --quantize 8|4` writes them.
OUR_DTYPES.update({f"q{b}": ("bfloat16", lambda model, b=b: quantize_t3(model, b)) for b in (8, 4)})


def fixed_inputs() -> tuple[list[int], list[int]]:
    """The same text ids (no SOT/EOT) and prompt speech ids for both systems and every run."""
    rng = random.Random(0)
    text = [rng.randrange(1, CFG.start_text_token) for _ in range(TEXT_LEN)]
    prompt = [rng.randrange(0, CFG.start_speech_token) for _ in range(PROMPT_LEN)]
    return text, prompt


def kv_bytes_per_step(tokens: int, itemsize: int) -> int:
    """KV cache bytes one decode step reads, averaged over the run (context grows from PREFILL_LEN)."""
    avg_len = PREFILL_LEN + tokens / 2
    return int(CFG.num_layers * 2 * BATCH * CFG.num_heads * avg_len * CFG.head_dim * itemsize)


def summarize(first_s: list[float], decode_s: list[float], tokens: int, bytes_per_step: int) -> dict:
    """Medians over the repeats; decode_s is the time of the tokens - 1 steps after the first token."""
    decode = statistics.median(decode_s)
    steps_per_s = (tokens - 1) / decode
    return dict(
        prefill_ms=round(1000 * statistics.median(first_s), 2),
        decode_tok_s=round(steps_per_s, 2),
        ms_per_step=round(1000 / steps_per_s, 3),
        gb_s=round(bytes_per_step * steps_per_s / 1e9, 2),
        bytes_per_step=bytes_per_step,
    )


def whole_run_timing(
    once: Callable[[int], float], tokens: int, repeats: int, reset_peak: Callable[[], object]
) -> tuple[float, float]:
    """(prefill + first sample, decode of tokens - 1 steps) in seconds, for loops timed only as whole runs
    (upstream's and mlx-audio's ``T3.inference``): after a warm-up, medians of ``once(tokens)`` and ``once(1)``.
    inference(n) = cond + prefill + n x (sample + forward), the loop running a forward after the last sample too,
    so (n - 1) steps = t(n) - t(1), and prefill + first sample = t(1) - one step."""
    once(tokens), once(1)  # warm-up
    reset_peak()
    t_one, t_all = [], []
    for _ in range(repeats):
        t_one.append(once(1))
        t_all.append(once(tokens))
    decode = statistics.median(t_all) - statistics.median(t_one)
    return statistics.median(t_one) - decode / (tokens - 1), decode


# --- ours (MLX) ---


def t3_voice(dtype: mx.Dtype):
    """A random voice with the fixed prompt tokens: all T3 reads of one."""
    from mlx_chatterbox.generation.voice import Voice

    voice = Voice(
        # In the model dtype, so that the prefill runs (and the KV cache is stored) in that dtype.
        speaker_emb=mx.random.normal((1, 256)).astype(dtype),
        t3_prompt_tokens=mx.array([fixed_inputs()[1]], dtype=mx.int32),
        s3gen_prompt_tokens=mx.zeros((1, 4), dtype=mx.int32),  # S3Gen parts: unused by T3
        s3gen_prompt_mel=mx.zeros((1, 8, 80)),
        xvector=mx.zeros((1, 192)),
    )
    mx.eval(voice.speaker_emb)
    return voice


def bench_ours(dtype_name: str, device: str, tokens: int, repeats: int) -> dict:
    from mlx_chatterbox.generation.speech_tokens import generate_speech_tokens
    from mlx_chatterbox.sampling import SamplingParams

    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    float_name, transform = OUR_DTYPES[dtype_name]
    dtype = getattr(mx, float_name)
    mx.random.seed(0)
    model = T3(CFG)
    model.set_dtype(dtype)  # floating parameters only
    if transform is not None:
        model = transform(model)
    mx.eval(model.parameters())
    text, voice = fixed_inputs()[0], t3_voice(dtype)
    params = SamplingParams(max_new_tokens=tokens, exaggeration=EXAGGERATION, **KNOBS)

    def once() -> tuple[float, float]:
        # The first token's time includes the prefill; the loop queues step i + 1 before yielding token i.
        t0 = time.perf_counter()
        ids = generate_speech_tokens(model, voice, text, params, key=mx.random.key(0), stop_on_eos=False)
        stamps = [time.perf_counter() for _ in ids]
        assert len(stamps) == tokens, f"expected {tokens} tokens, got {len(stamps)}"
        return stamps[0] - t0, stamps[-1] - stamps[0]

    once()  # warm-up
    mx.reset_peak_memory()
    runs = [once() for _ in range(repeats)]
    weight_bytes = t3_weight_bytes(model)
    itemsize = dtype.size  # the KV cache and embeddings stay in the float dtype when weights are quantized
    bytes_per_step = weight_bytes + 2 * CFG.hidden_size * itemsize + kv_bytes_per_step(tokens, itemsize)
    result = summarize([r[0] for r in runs], [r[1] for r in runs], tokens, bytes_per_step)
    result.update(
        peak_mem_bytes=mx.get_peak_memory(),
        peak_mem_kind="mx.get_peak_memory (weights included)",
        timing="prefill_ms = time to the first yielded token (cond + prefill + first sample); "
        "decode = first to last token",
        backend=_backend.STATUS,
        mlx_device_name=mx.device_info().get("device_name"),
    )
    del model
    mx.clear_cache()
    return result


# --- upstream (PyTorch) ---


def import_upstream_t3(src: str | None) -> types.ModuleType:
    """``chatterbox.models.t3.t3`` with the per-token progress bar silenced (see ``bare_upstream``)."""
    bare_upstream(src)
    import chatterbox.models.t3.t3 as t3_module

    t3_module.tqdm = lambda iterable, **_: iterable
    return t3_module


def bench_upstream(dtype_name: str, device: str | None, tokens: int, repeats: int, src: str | None) -> dict:
    import torch

    t3_module = import_upstream_t3(src)
    from chatterbox.models.t3.modules.cond_enc import T3Cond
    from chatterbox.models.t3.modules.t3_config import T3Config

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    refuse_torch_cpu_beside_preload(dev.type)
    dtype = getattr(torch, dtype_name)
    cuda = dev.type == "cuda"
    if cuda:
        # Upstream fp32 numerics: no TF32 matmuls (PyTorch's default, set explicitly here).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    with dev:  # initialise the random weights directly on the device
        t3 = t3_module.T3(T3Config.english_only())
    t3 = t3.to(dtype).eval()
    t3.hp.stop_speech_token = -1  # an id never sampled: EOS disabled
    text, prompt = fixed_inputs()
    text_tokens = torch.tensor([[CFG.start_text_token, *text, CFG.stop_text_token]] * BATCH, device=dev)
    speaker_emb = torch.randn(1, 256, device=dev, dtype=dtype)
    prompt_tokens = torch.tensor([prompt], device=dev)

    def once(n: int) -> float:
        # A fresh T3Cond each run: prepare_conditioning caches the prompt embedding inside it.
        cond = T3Cond(
            speaker_emb=speaker_emb,
            cond_prompt_speech_tokens=prompt_tokens,
            emotion_adv=EXAGGERATION * torch.ones(1, 1, 1, device=dev, dtype=dtype),
        )
        torch.manual_seed(0)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = t3.inference(t3_cond=cond, text_tokens=text_tokens, max_new_tokens=n, **KNOBS)
        sync()
        assert out.shape[-1] == n, f"expected {n} tokens, got {out.shape[-1]}"
        return time.perf_counter() - t0

    first, decode = whole_run_timing(
        once, tokens, repeats, lambda: cuda and torch.cuda.reset_peak_memory_stats(dev)
    )
    layers = list(t3.tfmr.layers) + [t3.tfmr.norm, t3.speech_head]
    weight_bytes = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
    itemsize = t3.speech_head.weight.element_size()
    bytes_per_step = weight_bytes + 2 * CFG.hidden_size * itemsize + kv_bytes_per_step(tokens, itemsize)
    result = summarize([first], [decode], tokens, bytes_per_step)
    result.update(
        torch_device=str(dev),
        peak_mem_bytes=torch.cuda.max_memory_allocated(dev) if cuda else None,
        peak_mem_kind="torch.cuda.max_memory_allocated (weights included)" if cuda else "not measured on CPU",
        timing="derived: decode = t(N) - t(1) over N - 1 steps; prefill_ms = t(1) - one step",
        tf32=bool(torch.backends.cuda.matmul.allow_tf32) if cuda else None,
        torch_threads=torch.get_num_threads(),
    )
    del t3
    if cuda:
        torch.cuda.empty_cache()
    return result


# --- mlx-audio (MLX, benchmark-only peer) ---


def bench_mlx_audio(dtype_name: str, device: str, tokens: int, repeats: int) -> dict:
    """mlx-audio's ``T3.inference`` on the same inputs and knobs. Like upstream's loop it has no hook between
    prefill and decode and runs one forward after the last sample, so it is timed the same way: t(N), t(1)."""
    import peer_mlx_audio as peer

    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    dtype = getattr(mx, dtype_name)
    model = peer.build_t3(dtype_name)
    text, prompt = fixed_inputs()
    speaker_emb = mx.random.normal((1, 256)).astype(dtype)

    def once(n: int) -> float:
        mx.random.seed(0)  # it samples from MLX's global generator
        t0 = time.perf_counter()
        got = peer.t3_generate(model, text, prompt, speaker_emb, n, KNOBS, EXAGGERATION)
        elapsed = time.perf_counter() - t0
        assert got == n, f"expected {n} tokens, got {got}"
        return elapsed

    first, decode = whole_run_timing(once, tokens, repeats, mx.reset_peak_memory)
    bytes_per_step = peer.t3_weight_bytes(model) + 2 * CFG.hidden_size * dtype.size
    bytes_per_step += kv_bytes_per_step(tokens, dtype.size)
    result = summarize([first], [decode], tokens, bytes_per_step)
    result.update(
        peak_mem_bytes=mx.get_peak_memory(),
        peak_mem_kind="mx.get_peak_memory (weights included)",
        timing="derived: decode = t(N) - t(1) over N - 1 steps; prefill_ms = t(1) - one step",
        backend=_backend.STATUS,
        mlx_audio=peer.peer_version(),
        eos_disabled="hp.stop_speech_token = -1",
    )
    del model
    mx.clear_cache()
    return result


# --- run description ---


def print_table(rows: list[dict]) -> None:
    head = f"{'system':10} {'dtype':9} {'device':7} {'tokens':>6} {'prefill ms':>10} {'tok/s':>8} "
    head += f"{'ms/step':>8} {'GB/s':>7} {'peak MiB':>9}"
    print(head, file=sys.stderr)
    for r in rows:
        peak = "-" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**20:.0f}"
        print(
            f"{r['system']:10} {r['dtype']:9} {r['device']:7} {r['tokens']:>6} {r['prefill_ms']:>10.1f} "
            f"{r['decode_tok_s']:>8.2f} {r['ms_per_step']:>8.2f} {r['gb_s']:>7.2f} {peak:>9}",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="ours,upstream", help="comma list of: " + ", ".join(SYSTEMS))
    p.add_argument("--tokens", type=int, default=300, help="speech tokens decoded per run (>= 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up; medians are reported")
    p.add_argument("--dtype", default="float32", help="comma list of: " + ", ".join(OUR_DTYPES))
    p.add_argument("--device", choices=("cpu", "gpu"), help="MLX device (default: gpu when MLX has one)")
    p.add_argument("--torch-device", choices=("cpu", "cuda"), help="upstream device (default: cuda if any)")
    p.add_argument("--upstream-src", help="folder that holds upstream's 'chatterbox' package folder")
    p.add_argument("--out", help="append the JSON lines to this file")
    p.add_argument(
        "--list-dtypes", action="store_true", help="print the --dtype names ours supports and exit"
    )
    args = p.parse_args(argv)
    if args.list_dtypes:
        print(",".join(OUR_DTYPES))
        return
    systems = args.systems.split(",")
    dtypes = args.dtype.split(",")
    if not set(systems) <= set(SYSTEMS) or not set(dtypes) <= set(OUR_DTYPES):
        p.error(f"unknown system or dtype; systems: {', '.join(SYSTEMS)}; dtypes: {', '.join(OUR_DTYPES)}")
    if args.tokens < 2 or args.repeats < 1:
        p.error("--tokens must be >= 2 and --repeats >= 1")
    mlx_device = args.device or ("gpu" if mx.is_available(mx.gpu) else "cpu")

    info = machine_info()
    print(f"# MLX backend settings: {_backend.STATUS}", file=sys.stderr)
    rows = []
    for dtype in dtypes:
        for system in systems:
            if system != "ours" and dtype not in FLOAT_DTYPES:
                print(f"# {system} {dtype}: skipped (only ours has quantized variants)", file=sys.stderr)
                continue
            print(f"# {system} {dtype} ...", file=sys.stderr)
            if system == "ours":
                res = bench_ours(dtype, mlx_device, args.tokens, args.repeats)
                device = mlx_device
            elif system == "mlx-audio":
                res = bench_mlx_audio(dtype, mlx_device, args.tokens, args.repeats)
                device = mlx_device
            else:
                res = bench_upstream(dtype, args.torch_device, args.tokens, args.repeats, args.upstream_src)
                device = res.pop("torch_device")
            row = dict(system=system, dtype=dtype, device=device, tokens=args.tokens, repeats=args.repeats)
            row.update(res, prefill_len=PREFILL_LEN, **info)
            write_line(row, args.out)
            rows.append(row)
    print_table(rows)


if __name__ == "__main__":
    main()
