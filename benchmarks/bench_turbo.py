"""Chatterbox-Turbo (or -Nano with ``--nano``) speed: ours (MLX) against upstream PyTorch, in one run.

Two parts, each timed for both systems:

- T3 decode: the GPT-2 T3 with random weights, a 375-token voice prompt and 40 text ids, Turbo's default
  sampling (temperature 0.8, top_k 1000, top_p 0.95, repetition penalty 1.2), EOS disabled so that every run
  yields exactly ``--tokens`` tokens. Ours: ``generate_turbo_tokens``; upstream: ``T3.inference_turbo``.
  Time to the first token (the prefill) and decode tok/s.
- S3Gen meanflow: speech tokens -> 24 kHz audio with the 2-step meanflow decoder, a 10 s voice prompt and
  ``--s3gen-tokens`` new tokens. Ours: ``S3Gen`` of ``Flow``, ``Estimator(CFMConfig(meanflow=True))``,
  ``HiFT``; upstream: ``S3Gen(meanflow=True).inference``. Seconds and RTF.

One warm-up run is excluded; medians of ``--repeats`` runs. A JSON line per measurement on stdout (and appended
to ``--out``) as soon as it is measured, a markdown table on stderr at the end. Upstream on a CPU runs in a
process of its own without our OpenBLAS preload and allocator setting (``common.refuse_torch_cpu_beside_preload``);
see benchmarks/README.md.

    python benchmarks/bench_turbo.py --systems ours,upstream --tokens 300 --repeats 3 \
        --device gpu --torch-device cuda --out benchmarks/out/turbo.jsonl
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
# Import our package (its __init__ runs first) before mlx.core: it preloads OpenBLAS and keeps fp32 matmuls
# in fp32 (see _backend.py).
from mlx_chatterbox import _backend  # isort: skip

import argparse
import contextlib
import functools
import gc
import importlib
import json
import os
import random
import statistics
import subprocess
import time
from collections.abc import Callable

import bench_s3gen
import mlx.core as mx
import numpy as np
from bench_t3 import import_upstream_t3, summarize
from common import bare_upstream, machine_info, refuse_torch_cpu_beside_preload, write_line
from mlx.utils import tree_flatten, tree_unflatten

from mlx_chatterbox import variants
from mlx_chatterbox.convert import sanitize_s3gen_part, split_s3gen
from mlx_chatterbox.generation.turbo import generate_turbo_tokens, prefill_length
from mlx_chatterbox.generation.vocode import S3Gen
from mlx_chatterbox.generation.voice import Voice
from mlx_chatterbox.models.cfm import Estimator
from mlx_chatterbox.models.flow import Flow
from mlx_chatterbox.models.gpt2 import NANO, TURBO, T3Turbo, T3TurboConfig
from mlx_chatterbox.models.hift import HiFT
from mlx_chatterbox.sampling import TurboParams

SYSTEMS = ("ours", "upstream")
PARTS = ("t3", "s3gen")
DTYPES = ("float32", "bfloat16", "float16")
TEXT_LEN = 40  # GPT-2 text ids (Turbo adds no start/stop text ids)
PROMPT_LEN = 375  # T3 conditioning prompt tokens: Turbo's 15 s of reference
GPT2_TEXT_IDS = 50257  # byte-level BPE ids; the 19 tags above them are left out
KNOBS = TurboParams()  # upstream ChatterboxTurboTTS.generate's defaults; max_new_tokens is set per run
# --tiny: a 2-layer, 64-wide T3 (ours and upstream), and upstream's fixed-size S3Gen on 1 s of prompt and audio.
TINY = T3TurboConfig(hidden_size=64, num_layers=2, num_heads=4)
TINY_S3GEN_TOKENS = 25
S3GEN_CONFIG = variants.TURBO  # Turbo and Nano share S3Gen (s3gen_meanflow.safetensors)


def t3_config(args: argparse.Namespace) -> T3TurboConfig:
    return TINY if args.tiny else NANO if args.nano else TURBO


def model_name(args: argparse.Namespace) -> str:
    return "tiny" if args.tiny else "nano" if args.nano else "turbo"


def fixed_t3_inputs() -> tuple[list[int], list[int]]:
    """The same text ids and prompt speech ids for both systems and every run."""
    rng = random.Random(0)
    text = [rng.randrange(0, GPT2_TEXT_IDS) for _ in range(TEXT_LEN)]
    prompt = [rng.randrange(0, 6561) for _ in range(PROMPT_LEN)]
    return text, prompt


def kv_bytes_per_step(cfg: T3TurboConfig, prefill_len: int, tokens: int, itemsize: int) -> int:
    """KV cache bytes one decode step reads, averaged over the run (no CFG: batch 1)."""
    return int(cfg.num_layers * 2 * cfg.num_heads * (prefill_len + tokens / 2) * cfg.head_dim * itemsize)


# --- T3: ours (MLX) ---


def random_t3(cfg: T3TurboConfig, dtype: mx.Dtype) -> T3Turbo:
    """T3Turbo with small normal weights (LayerNorm weights near 1), in ``dtype``."""
    mx.random.seed(0)
    model = T3Turbo(cfg)
    params = []
    for name, p in tree_flatten(model.parameters()):
        noise = 0.02 * mx.random.normal(p.shape)
        params.append((name, 1 + noise if "ln_" in name and name.endswith("weight") else noise))
    model.update(tree_unflatten(params))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def bench_t3_ours(cfg: T3TurboConfig, dtype_name: str, tokens: int, repeats: int) -> dict:
    dtype = getattr(mx, dtype_name)
    model = random_t3(cfg, dtype)
    text, prompt = fixed_t3_inputs()
    voice = Voice(
        # In the model dtype, so that the prefill runs (and the KV cache is stored) in that dtype.
        speaker_emb=mx.random.normal((1, cfg.speaker_embed_size)).astype(dtype),
        t3_prompt_tokens=mx.array([prompt], dtype=mx.int32),
        s3gen_prompt_tokens=mx.zeros((1, 4), dtype=mx.int32),  # S3Gen parts: unused by T3
        s3gen_prompt_mel=mx.zeros((1, 8, 80)),
        xvector=mx.zeros((1, 192)),
    )
    mx.eval(voice.speaker_emb)
    # generate_turbo_tokens yields 1 + max_new_tokens tokens.
    params = TurboParams(
        temperature=KNOBS.temperature,
        top_k=KNOBS.top_k,
        top_p=KNOBS.top_p,
        repetition_penalty=KNOBS.repetition_penalty,
        max_new_tokens=tokens - 1,
    )

    def once() -> tuple[float, float]:
        # The first token's time includes the prefill; the loop queues step i + 1 before yielding token i.
        t0 = time.perf_counter()
        ids = generate_turbo_tokens(model, voice, text, params, key=mx.random.key(0), stop_on_eos=False)
        stamps = [time.perf_counter() for _ in ids]
        assert len(stamps) == tokens, f"expected {tokens} tokens, got {len(stamps)}"
        return stamps[0] - t0, stamps[-1] - stamps[0]

    once()  # warm-up (also traces the compiled step at every cache capacity the run reaches)
    mx.reset_peak_memory()
    runs = [once() for _ in range(repeats)]
    prefill_len = prefill_length(model, voice, text)
    # Every array one step reads: the blocks, the final LayerNorm and the speech head.
    read = [b.parameters() for b in model.tfmr.h] + [
        model.tfmr.ln_f.parameters(),
        model.speech_head.parameters(),
    ]
    bytes_per_step = sum(v.nbytes for _, v in tree_flatten(read))
    bytes_per_step += 2 * cfg.hidden_size * dtype.size  # the fed token's speech_emb row and its wpe row
    bytes_per_step += kv_bytes_per_step(cfg, prefill_len, tokens, dtype.size)
    result = summarize([r[0] for r in runs], [r[1] for r in runs], tokens, bytes_per_step)
    result.update(
        prefill_len=prefill_len,
        peak_mem_bytes=mx.get_peak_memory(),
        peak_mem_kind="mx.get_peak_memory (weights included)",
        timing="prefill_ms = time to the first yielded token (cond + prefill + first sample); "
        "decode = first to last token",
        eos_disabled="stop_on_eos=False",
        backend=_backend.STATUS,
    )
    return result


# --- T3: upstream (PyTorch) ---


def upstream_config_name(cfg: T3TurboConfig) -> str:
    """The ``LLAMA_CONFIGS`` entry for ``cfg``; Nano's ``GPT2_small`` (upstream HEAD: GPT2_medium with 768 / 12 /
    12) and the tiny one are registered where 0.1.7 lacks them, as tests/reference/test_t3_turbo_parity.py does.
    """
    from chatterbox.models.t3.llama_configs import GPT2_MEDIUM_CONFIG, LLAMA_CONFIGS

    if cfg == TURBO:
        return "GPT2_medium"
    name = "GPT2_small" if cfg == NANO else "bench_gpt2_tiny"
    LLAMA_CONFIGS.setdefault(
        name,
        dict(
            GPT2_MEDIUM_CONFIG,
            n_embd=cfg.hidden_size,
            hidden_size=cfg.hidden_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_positions=cfg.n_positions,
            n_ctx=cfg.n_positions,
            vocab_size=cfg.text_vocab_size,
        ),
    )
    return name


def torch_device(torch, name: str | None):
    dev = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    refuse_torch_cpu_beside_preload(dev.type)
    if dev.type == "cuda":
        # Upstream fp32 numerics: no TF32 matmuls (PyTorch's default, set explicitly here).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return dev


def bench_t3_upstream(
    cfg: T3TurboConfig, dtype_name: str, device: str | None, tokens: int, repeats: int, src: str | None
) -> dict:
    import torch

    t3_module = import_upstream_t3(src)  # progress bar silenced
    from chatterbox.models.t3.modules.cond_enc import T3Cond
    from chatterbox.models.t3.modules.t3_config import T3Config

    dev = torch_device(torch, device)
    cuda = dev.type == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = getattr(torch, dtype_name)
    # The hp ChatterboxTurboTTS.from_local builds (tts_turbo.py).
    hp = T3Config(text_tokens_dict_size=cfg.text_vocab_size)
    hp.llama_config_name = upstream_config_name(cfg)
    hp.speech_tokens_dict_size = cfg.speech_vocab_size
    hp.input_pos_emb = None
    hp.speech_cond_prompt_len = cfg.speech_cond_prompt_len
    hp.use_perceiver_resampler = False
    hp.emotion_adv = False
    torch.manual_seed(0)
    with dev:  # transformers' random initialisation (normal, std 0.02), directly on the device
        t3 = t3_module.T3(hp)
    t3 = t3.to(dtype).eval()
    t3.hp.stop_speech_token = -1  # an id never drawn: EOS disabled
    text, prompt = fixed_t3_inputs()
    text_tokens = torch.tensor([text], device=dev)
    speaker_emb = torch.randn(1, cfg.speaker_embed_size, device=dev, dtype=dtype)
    prompt_tokens = torch.tensor([prompt], device=dev)

    def once(n: int) -> float:
        """inference_turbo(max_gen_len=n): cond + prefill + the first sample, then n x (forward + sample)."""
        # A fresh T3Cond each run: prepare_conditioning caches the prompt embedding inside it.
        cond = T3Cond(
            speaker_emb=speaker_emb,
            cond_prompt_speech_tokens=prompt_tokens,
            emotion_adv=0.5 * torch.ones(1, 1, 1, device=dev, dtype=dtype),  # unused: hp.emotion_adv is False
        )
        torch.manual_seed(0)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = t3.inference_turbo(
                cond,
                text_tokens,
                temperature=KNOBS.temperature,
                top_k=KNOBS.top_k,
                top_p=KNOBS.top_p,
                repetition_penalty=KNOBS.repetition_penalty,
                max_gen_len=n,
            )
        sync()
        elapsed = time.perf_counter() - t0
        assert out.shape[-1] == n + 1, f"expected {n + 1} tokens, got {out.shape[-1]}"
        return elapsed

    once(tokens - 1), once(0)  # warm-up
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t_first, t_all = [], []
    for _ in range(repeats):
        t_first.append(once(0))
        t_all.append(once(tokens - 1))
    # Its loop has no hook after the first token, but max_gen_len=0 stops right there: the first token's time
    # is t(0) itself, and the tokens - 1 decode steps take t(N - 1) - t(0).
    first = statistics.median(t_first)
    decode = statistics.median(t_all) - first
    prefill_len = 1 + len(prompt) + len(text) + 1
    layers = list(t3.tfmr.h) + [t3.tfmr.ln_f, t3.speech_head]
    bytes_per_step = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
    itemsize = t3.speech_head.weight.element_size()
    bytes_per_step += 2 * cfg.hidden_size * itemsize + kv_bytes_per_step(cfg, prefill_len, tokens, itemsize)
    result = summarize([first], [decode], tokens, bytes_per_step)
    result.update(
        prefill_len=prefill_len,
        torch_device=str(dev),
        peak_mem_bytes=torch.cuda.max_memory_allocated(dev) if cuda else None,
        peak_mem_kind="torch.cuda.max_memory_allocated (weights included)" if cuda else "not measured on CPU",
        timing="derived: prefill_ms = t(max_gen_len=0); decode = t(N - 1) - t(0) over N - 1 steps",
        eos_disabled="hp.stop_speech_token = -1",
        tf32=bool(torch.backends.cuda.matmul.allow_tf32) if cuda else None,
        torch_threads=torch.get_num_threads(),
    )
    return result


# --- S3Gen meanflow ---


@contextlib.contextmanager
def meanflow_decoder():
    """``bench_s3gen.build_upstream`` builds upstream's ``ConditionalDecoder`` with S3Token2Mel's arguments;
    meanwhile it gets ``meanflow=True`` too, as ``S3Token2Mel(meanflow=True)`` passes it."""
    # import_module: ``import a.b.c as m`` fails on the bare ``chatterbox`` namespace (common.bare_upstream).
    decoder_module = importlib.import_module("chatterbox.models.s3gen.decoder")
    original = decoder_module.ConditionalDecoder
    decoder_module.ConditionalDecoder = functools.partial(original, meanflow=True)
    try:
        yield
    finally:
        decoder_module.ConditionalDecoder = original


def upstream_networks(torch, device, src: str | None):
    """Upstream's flow (meanflow estimator) and HiFT, built and randomised by ``bench_s3gen.build_upstream``
    (seeded: the same weights in every process)."""
    bare_upstream(src)
    with meanflow_decoder():
        return bench_s3gen.build_upstream(torch, device)


def ours_s3gen(flow, hift) -> S3Gen:
    """Our meanflow S3Gen with upstream's weights, through our conversion (``bench_s3gen.ours_from`` with the
    Turbo variant's networks: ``Estimator(CFMConfig(meanflow=True))``)."""
    state = {f"flow.{k}": v for k, v in flow.state_dict().items()}
    state.update({f"mel2wav.{k}": v for k, v in hift.state_dict().items()})
    parts = split_s3gen({k: mx.array(v.detach().float().cpu().numpy()) for k, v in state.items()})
    nets = {}
    for name, network in (("flow", Flow), ("cfm", Estimator), ("hift", HiFT)):
        nets[name] = network(getattr(S3GEN_CONFIG, name))
        weights = sanitize_s3gen_part(parts[name], name, S3GEN_CONFIG)
        nets[name].load_weights(list(weights.items()), strict=True)
    mx.eval([n.parameters() for n in nets.values()])
    return S3Gen(nets["flow"], nets["cfm"], nets["hift"])


def s3gen_row(total_s: list[float], tokens: int) -> dict:
    total = statistics.median(total_s)
    audio_s = tokens * bench_s3gen.TOKEN_SECONDS
    return dict(audio_s=audio_s, total_s=round(total, 4), rtf=round(total / audio_s, 4))


def bench_s3gen_ours(prompt_tokens: int, tokens: int, steps: int, repeats: int, src: str | None) -> dict:
    import torch

    flow, hift = upstream_networks(torch, torch.device("cpu"), src)  # only to make the weights
    s3gen = ours_s3gen(flow, hift)
    del flow, hift
    inputs = bench_s3gen.fixed_inputs(prompt_tokens, tokens)
    voice = bench_s3gen.fixed_voice(inputs)
    ids = mx.array(inputs["token"].astype(np.int32))

    def once() -> float:
        t0 = time.perf_counter()
        wav = s3gen(ids, voice, cfm_steps=steps, key=mx.random.key(0))
        mx.eval(wav)
        elapsed = time.perf_counter() - t0
        assert wav.shape[1] == tokens * 2 * 480, wav.shape
        return elapsed

    once()  # warm-up
    mx.reset_peak_memory()
    result = s3gen_row([once() for _ in range(repeats)], tokens)
    result.update(
        peak_mem_bytes=mx.get_peak_memory(),
        peak_mem_kind="mx.get_peak_memory (weights included)",
        timing="S3Gen(tokens, voice, cfm_steps, key) evaluated: flow, meanflow CFM, HiFT, fade-in",
        memory_budget=s3gen.memory_budget,
        backend=_backend.STATUS,
    )
    return result


def bench_s3gen_upstream(
    prompt_tokens: int, tokens: int, steps: int, repeats: int, device: str | None, src: str | None
) -> dict:
    import torch

    dev = torch_device(torch, device)
    cuda = dev.type == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    flow, hift = upstream_networks(torch, dev, src)
    # S3Token2Wav(meanflow=True).inference's steps, written out: s3gen.py itself imports librosa, torchaudio and
    # s3tokenizer, absent on the device machine, and its tokenizer and speaker encoder are not run here.
    importlib.import_module("chatterbox.models.s3gen.flow_matching").tqdm = lambda iterable, **_: iterable
    n_trim = bench_s3gen.SAMPLE_RATE // 50
    trim_fade = torch.zeros(2 * n_trim, device=dev)
    trim_fade[n_trim:] = (torch.cos(torch.linspace(torch.pi, 0, n_trim, device=dev)) + 1) / 2
    inputs = {
        k: torch.from_numpy(np.asarray(v)).to(dev)
        for k, v in bench_s3gen.fixed_inputs(prompt_tokens, tokens).items()
    }

    @torch.inference_mode()
    def once() -> float:
        torch.manual_seed(0)
        sync()
        t0 = time.perf_counter()
        token = inputs["token"]
        noise = torch.randn(1, 80, token.size(-1) * 2, device=dev)  # flow_inference's draw for meanflow
        with contextlib.redirect_stdout(sys.stderr):  # its "S3 Token -> Mel Inference..." print
            mels, _ = flow.inference(
                token=token,
                token_len=torch.tensor([token.size(-1)], device=dev),
                prompt_token=inputs["prompt_token"],
                prompt_token_len=torch.tensor([prompt_tokens], device=dev),
                prompt_feat=inputs["prompt_feat"],
                prompt_feat_len=None,
                embedding=inputs["embedding"],
                finalize=True,
                noised_mels=noise,
                n_timesteps=steps,
                meanflow=True,
            )
        wav, _ = hift.inference(speech_feat=mels, cache_source=torch.zeros(1, 1, 0, device=dev))
        wav[:, : len(trim_fade)] *= trim_fade
        sync()
        elapsed = time.perf_counter() - t0
        assert wav.shape[1] == tokens * 2 * 480, wav.shape
        return elapsed

    once()  # warm-up
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    result = s3gen_row([once() for _ in range(repeats)], tokens)
    result.update(
        torch_device=str(dev),
        peak_mem_bytes=torch.cuda.max_memory_allocated(dev) if cuda else None,
        peak_mem_kind="torch.cuda.max_memory_allocated (weights included)" if cuda else "not measured on CPU",
        timing="S3Token2Wav(meanflow=True).inference's steps: noise draw, flow.inference, HiFT, fade-in; synchronised around them",
        tf32=bool(torch.backends.cuda.matmul.allow_tf32) if cuda else None,
        torch_threads=torch.get_num_threads(),
    )
    return result


# --- running ---


def run_system(
    system: str, args: argparse.Namespace, mlx_device: str, info: dict, emit: Callable[[dict], None]
) -> None:
    """Every part for one system in this process; each row is handed to ``emit`` as soon as it is measured."""
    cfg = t3_config(args)
    for part in args.parts:
        print(f"# {system} {part} ...", file=sys.stderr, flush=True)
        row = dict(system=system, part=part, model=model_name(args))
        if part == "t3":
            if system == "ours":
                res = bench_t3_ours(cfg, args.dtype, args.tokens, args.repeats)
            else:
                res = bench_t3_upstream(
                    cfg, args.dtype, args.torch_device, args.tokens, args.repeats, args.upstream_src
                )
            row.update(dtype=args.dtype, tokens=args.tokens)
        else:
            sizes = (args.s3gen_prompt_tokens, args.s3gen_tokens, args.s3gen_steps, args.repeats)
            if system == "ours":
                res = bench_s3gen_ours(*sizes, args.upstream_src)
            else:
                res = bench_s3gen_upstream(*sizes, args.torch_device, args.upstream_src)
            row.update(
                dtype="float32",
                prompt_tokens=args.s3gen_prompt_tokens,
                tokens=args.s3gen_tokens,
                steps=args.s3gen_steps,
            )
        row.update(device=res.pop("torch_device", mlx_device), repeats=args.repeats)
        row.update(res, **info)
        emit(row)
        release_memory()


def release_memory() -> None:
    """Hand back what the last part's models held (they are gone with its function's frame)."""
    gc.collect()
    mx.clear_cache()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def child_args(args: argparse.Namespace, system: str) -> list[str]:
    """This script's command line for one system, run as a child (``--child``)."""
    out = ["--systems", system, "--parts", ",".join(args.parts), "--tokens", str(args.tokens)]
    out += ["--s3gen-tokens", str(args.s3gen_tokens), "--s3gen-prompt-tokens", str(args.s3gen_prompt_tokens)]
    out += ["--s3gen-steps", str(args.s3gen_steps), "--repeats", str(args.repeats), "--dtype", args.dtype]
    out += ["--torch-device", args.torch_device, "--child"]
    if args.device:
        out += ["--device", args.device]
    out += ["--nano"] * args.nano + ["--tiny"] * args.tiny
    out += ["--upstream-src", args.upstream_src] if args.upstream_src else []
    return out


def run_upstream_child(args: argparse.Namespace, emit: Callable[[dict], None]) -> int:
    """Upstream in a process of its own, as its users run it: none of our process-wide settings (_backend.py;
    as compare.py runs it). Its JSON lines are handed to ``emit`` as they come; its stderr passes through."""
    env = dict(os.environ, MLX_CHATTERBOX_BLAS="off", MLX_CHATTERBOX_MALLOC="off")
    cmd = [sys.executable, str(Path(__file__).resolve()), *child_args(args, "upstream")]
    print(
        "# upstream in its own process (torch on the CPU, no OpenBLAS preload): " + " ".join(cmd[1:]),
        file=sys.stderr,
        flush=True,
    )
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc:
        for line in proc.stdout:
            if line.startswith("{"):
                emit(json.loads(line))
            else:
                print(line, end="", file=sys.stderr)
    if proc.returncode:
        print(f"# upstream process failed: rc {proc.returncode}", file=sys.stderr)
    return proc.returncode


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def mib(row: dict) -> str:
    return "-" if row.get("peak_mem_bytes") is None else f"{row['peak_mem_bytes'] / 2**20:.0f}"


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = []
    t3 = [r for r in rows if r["part"] == "t3"]
    if t3:
        up = next((r["decode_tok_s"] for r in t3 if r["system"] == "upstream"), None)
        lines += [
            f"T3 {model_name(args)} ({args.dtype}, {args.tokens} tokens, prefill {t3[0]['prefill_len']} positions)",
            "",
            "| system | device | prefill ms | decode tok/s | ms/step | GB/s | x vs upstream | peak MiB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in t3:
            cells = [r["system"], r["device"], fmt(r["prefill_ms"], ".1f"), fmt(r["decode_tok_s"], ".2f")]
            cells += [fmt(r["ms_per_step"], ".2f"), fmt(r["gb_s"], ".2f")]
            cells += ["-" if not up else f"{r['decode_tok_s'] / up:.2f}x", mib(r)]
            lines.append("| " + " | ".join(cells) + " |")
    s3 = [r for r in rows if r["part"] == "s3gen"]
    if s3:
        up = next((r["total_s"] for r in s3 if r["system"] == "upstream"), None)
        lines += [""] if lines else []
        lines += [
            f"S3Gen meanflow (prompt {args.s3gen_prompt_tokens} + {args.s3gen_tokens} tokens = "
            f"{s3[0]['audio_s']:g} s of audio, {args.s3gen_steps} steps, float32)",
            "",
            "| system | device | total s | RTF | x vs upstream | peak MiB |",
            "|---|---|---|---|---|---|",
        ]
        for r in s3:
            cells = [r["system"], r["device"], fmt(r["total_s"], ".3f"), fmt(r["rtf"], ".4f")]
            cells += ["-" if not up else f"{up / r['total_s']:.2f}x", mib(r)]
            lines.append("| " + " | ".join(cells) + " |")
    info = rows[0] if rows else machine_info()
    lines += [
        "",
        f"Machine: {info['gpu'] or info['cpu']} ({info['platform']}); versions {info['versions']}; "
        f"commit {info['commit']}; {info['date']}; median of {args.repeats} after a warm-up.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="ours,upstream", help="comma list of: " + ", ".join(SYSTEMS))
    p.add_argument("--parts", default="t3,s3gen", help="comma list of: " + ", ".join(PARTS))
    p.add_argument("--tokens", type=int, default=300, help="T3: speech tokens per run (>= 2)")
    p.add_argument(
        "--s3gen-tokens",
        type=int,
        help=f"S3Gen: new tokens (25 per s; 250, or {TINY_S3GEN_TOKENS} with --tiny)",
    )
    p.add_argument(
        "--s3gen-prompt-tokens",
        type=int,
        help=f"S3Gen: voice prompt tokens (250 = 10 s, or {TINY_S3GEN_TOKENS} with --tiny)",
    )
    p.add_argument("--s3gen-steps", type=int, default=2, help="S3Gen: meanflow steps (Turbo's 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up; medians are reported")
    p.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="T3 weights and activations (S3Gen: fp32)"
    )
    p.add_argument("--device", choices=("cpu", "gpu"), help="MLX device (default: gpu when MLX has one)")
    p.add_argument("--torch-device", choices=("cpu", "cuda"), help="upstream device (default: cuda if any)")
    p.add_argument(
        "--nano", action="store_true", help="Chatterbox-Nano's T3 (GPT-2 small) instead of Turbo's"
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="smoke run: a 2-layer 64-wide T3 (instead of --nano's), S3Gen on 1 s",
    )
    p.add_argument("--upstream-src", help="folder that holds upstream's 'chatterbox' package folder")
    p.add_argument("--out", help="append the JSON lines to this file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one system, rows on stdout only
    args = p.parse_args(argv)
    systems, args.parts = args.systems.split(","), args.parts.split(",")
    if not set(systems) <= set(SYSTEMS) or not set(args.parts) <= set(PARTS):
        p.error(f"systems: {', '.join(SYSTEMS)}; parts: {', '.join(PARTS)}")
    default_s3gen = TINY_S3GEN_TOKENS if args.tiny else 250
    args.s3gen_tokens = default_s3gen if args.s3gen_tokens is None else args.s3gen_tokens
    args.s3gen_prompt_tokens = default_s3gen if args.s3gen_prompt_tokens is None else args.s3gen_prompt_tokens
    if args.tokens < 2 or args.repeats < 1 or args.s3gen_tokens < 1 or args.s3gen_prompt_tokens < 0:
        p.error("--tokens must be >= 2, --repeats and --s3gen-tokens >= 1, --s3gen-prompt-tokens >= 0")
    if args.s3gen_steps < 1:
        p.error("--s3gen-steps must be >= 1")
    if "upstream" in systems and args.torch_device is None:
        import torch

        args.torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    mlx_device = args.device or ("gpu" if mx.is_available(mx.gpu) else "cpu")
    mx.set_default_device(mx.gpu if mlx_device == "gpu" else mx.cpu)

    info = machine_info()
    if not args.child:
        print(f"# MLX backend settings: {_backend.STATUS}", file=sys.stderr)
    rows: list[dict] = []

    def emit(row: dict) -> None:
        write_line(row, None if args.child else args.out)
        rows.append(row)

    failed = 0
    for system in systems:
        beside_preload = _backend.BLAS_PRELOADED or _backend.MALLOC_TUNED
        if system == "upstream" and args.torch_device == "cpu" and beside_preload and not args.child:
            failed |= run_upstream_child(args, emit)
        else:
            run_system(system, args, mlx_device, info, emit)
    if not args.child:
        print("\n" + markdown(rows, args), file=sys.stderr)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
