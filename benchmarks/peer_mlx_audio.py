"""mlx-audio's Chatterbox as a benchmark-only peer: its T3 and S3Gen built with random weights through its own
constructors (full-size English), run through its own generation code, and timed as bench_t3.py and
bench_s3gen.py time ours. Only the benchmarks import mlx-audio; the library and the tests never do.

    pip install --no-deps mlx-audio==0.6.2
    python benchmarks/peer_mlx_audio.py --prompt-tokens 250 --tokens 250 --repeats 3 --out benchmarks/out/s3gen.jsonl

T3 runs from bench_t3.py (``--systems mlx-audio``). This script's own command line times S3Gen.
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
# The peer gets the same MLX settings as ours (OpenBLAS preload on Linux, true fp32 matmuls): see _backend.py.
import mlx_chatterbox  # noqa: F401  isort: skip
from mlx_chatterbox import _backend  # isort: skip

import argparse
import importlib
import importlib.metadata
import importlib.util
import statistics
import time
import types
from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from common import machine_info, write_line
from mlx.utils import tree_flatten

PACKAGE = "mlx_audio.tts.models.chatterbox"
VERSION = "0.6.2"  # the release these adapters were written against
TOKEN_SECONDS = 0.04


def peer_version() -> str | None:
    try:
        return importlib.metadata.version("mlx-audio")
    except importlib.metadata.PackageNotFoundError:
        return None


def import_peer(name: str) -> types.ModuleType:
    """A submodule of mlx-audio's chatterbox, without running the ``__init__.py`` of ``mlx_audio``,
    ``mlx_audio.tts``, ``.models`` or ``.chatterbox`` (they import the whole TTS: model registry, the
    Hugging Face loader, tokenizers). The T3 subtree then needs only mlx; S3Gen also imports ``mlx_audio.utils``
    (numpy, huggingface_hub)."""
    if "mlx_audio" not in sys.modules:
        spec = importlib.util.find_spec("mlx_audio")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"mlx-audio not found: pip install --no-deps mlx-audio=={VERSION}")
        root = Path(list(spec.submodule_search_locations)[0])
        for package in ("mlx_audio", "mlx_audio.tts", "mlx_audio.tts.models", PACKAGE):
            module = types.ModuleType(package)
            module.__path__ = [str(root.joinpath(*package.split(".")[1:]))]
            sys.modules[package] = module
    return importlib.import_module(f"{PACKAGE}.{name}")


# --- T3 ---


def build_t3(dtype_name: str) -> object:
    """mlx-audio's English T3 (Llama-520M, its default config), random weights, EOS disabled."""
    config = import_peer("config")
    t3 = import_peer("t3.t3")
    mx.random.seed(0)
    model = t3.T3(config.T3Config.english_only())
    model.set_dtype(getattr(mx, dtype_name))
    # Its loop stops when the sampled id equals hp.stop_speech_token; -1 is never sampled.
    model.hp.stop_speech_token = -1
    mx.eval(model.parameters())
    return model


def t3_weight_bytes(model: object) -> int:
    """Bytes of what a decode step reads: the Llama layers and final norm, and the speech head (as bench_t3)."""
    backbone = {
        k: v for k, v in tree_flatten(model.tfmr.model.parameters()) if not k.startswith("embed_tokens")
    }
    head = tree_flatten(model.speech_head.parameters())
    return sum(v.nbytes for v in backbone.values()) + sum(v.nbytes for _, v in head)


def t3_generate(
    model: object,
    text: Sequence[int],
    prompt: Sequence[int],
    speaker_emb: mx.array,
    tokens: int,
    knobs: dict,
    exaggeration: float,
) -> int:
    """mlx-audio's ``T3.inference`` as its ``Model.generate`` calls it (CFG rows, SOT/EOT); returns the number of
    tokens it generated. ``text`` and ``prompt`` are ids without SOT/EOT."""
    cond_enc = import_peer("t3.cond_enc")
    hp = model.hp
    dtype = model.speech_head.weight.dtype
    cond = cond_enc.T3Cond(
        speaker_emb=speaker_emb,
        cond_prompt_speech_tokens=mx.array([list(prompt)], dtype=mx.int32),
        emotion_adv=(exaggeration * mx.ones((1, 1, 1))).astype(dtype),
    )
    ids = mx.array([[hp.start_text_token, *text, hp.stop_text_token]] * 2, dtype=mx.int32)
    out = model.inference(t3_cond=cond, text_tokens=ids, max_new_tokens=tokens, **knobs)
    mx.eval(out)
    return out.shape[-1] - 1  # its output starts with the start-of-speech id


# --- S3Gen ---


def build_s3gen(steps: int) -> object:
    """mlx-audio's ``S3Token2Wav`` (flow encoder, CFM, HiFT; also CAM++, unused here), random weights."""
    s3gen = import_peer("s3gen.s3gen")
    mx.random.seed(0)
    model = s3gen.S3Token2Wav()
    model.flow.n_timesteps = steps  # its Euler steps (upstream's 10 by default)
    mx.eval(model.parameters())
    return model


def s3gen_ref(inputs: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """bench_s3gen.fixed_inputs as mlx-audio's ``ref_dict`` (what its ``embed_ref`` returns)."""
    prompt = inputs["prompt_token"].astype(np.int32)
    feat = inputs["prompt_feat"]
    return dict(
        prompt_token=mx.array(prompt),
        prompt_token_len=mx.array([prompt.shape[1]]),
        prompt_feat=mx.array(feat),
        prompt_feat_len=mx.array([feat.shape[1]]),
        embedding=mx.array(inputs["embedding"]),
    )


def bench_s3gen(model: object, inputs: dict[str, np.ndarray], steps: int, repeats: int) -> dict:
    """Tokens -> waveform through ``S3Token2Wav.__call__`` (what its ``Model.generate`` calls), then the flow
    (encoder + CFM) and HiFT alone. Medians over ``repeats`` runs after a warm-up; peak over the whole call.
    """
    ref = s3gen_ref(inputs)
    tokens = mx.array(inputs["token"].astype(np.int32))

    def once() -> dict:
        mx.random.seed(0)  # it draws its CFM noise and SineGen phases from the global generator
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        mx.eval(model(tokens, ref_dict=ref, finalize=True))
        t1 = time.perf_counter()
        peak = mx.get_peak_memory()
        mel = model.flow_inference(tokens, ref_dict=ref, finalize=True)
        mx.eval(mel)
        t2 = time.perf_counter()
        mx.eval(model.hift_inference(mel))
        t3 = time.perf_counter()
        return dict(
            total_ms=1e3 * (t1 - t0), flow_ms=1e3 * (t2 - t1), hift_ms=1e3 * (t3 - t2), peak_mem_bytes=peak
        )

    once()
    runs = [once() for _ in range(repeats)]
    result = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    audio_s = inputs["token"].shape[1] * TOKEN_SECONDS
    result.update(
        rtf=round(result["total_ms"] / 1e3 / audio_s, 4),
        # The flow's encoder and CFM are one call here: flow_ms holds both, and no per-stage split is claimed.
        encoder_ms=None,
        cfm_ms=None,
        cfm_step_ms=None,
        peak_mem_kind="mx.get_peak_memory over the whole call, weights included",
        backend=_backend.STATUS,
        mlx_audio=peer_version(),
    )
    return result


def main(argv: list[str] | None = None) -> None:
    from bench_s3gen import fixed_inputs  # the same prompt, tokens and x-vector as ours

    p = argparse.ArgumentParser(description="S3Gen speed of mlx-audio's Chatterbox (tokens -> 24 kHz audio)")
    p.add_argument("--prompt-tokens", type=int, default=250, help="voice prompt tokens (250 = 10 s)")
    p.add_argument("--tokens", type=int, default=250, help="new speech tokens (25 per second of audio)")
    p.add_argument("--steps", type=int, default=10, help="CFM Euler steps")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up; medians are reported")
    p.add_argument("--device", choices=("cpu", "gpu"), help="MLX device (default: gpu when MLX has one)")
    p.add_argument("--out", help="append the JSON lines to this file")
    args = p.parse_args(argv)
    device = args.device or ("gpu" if mx.is_available(mx.gpu) else "cpu")
    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    print(f"# mlx-audio {peer_version()} S3Gen on {device} ...", file=sys.stderr)
    res = bench_s3gen(
        build_s3gen(args.steps), fixed_inputs(args.prompt_tokens, args.tokens), args.steps, args.repeats
    )
    row = dict(system="mlx-audio", device=device, prompt_tokens=args.prompt_tokens, tokens=args.tokens)
    row.update(
        steps=args.steps, repeats=args.repeats, audio_s=args.tokens * TOKEN_SECONDS, **res, **machine_info()
    )
    write_line(row, args.out)
    print(
        f"mlx-audio {device}: total {res['total_ms']:.1f} ms, RTF {res['rtf']:.4f}, flow {res['flow_ms']:.1f} ms, "
        f"HiFT {res['hift_ms']:.1f} ms, peak {res['peak_mem_bytes'] / 2**20:.0f} MiB",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
