"""S3Gen speed: speech tokens -> 24 kHz audio, ours (MLX) against upstream PyTorch, in one run.

Full-size S3Gen (flow encoder, flow-matching decoder with CFG, HiFT vocoder), random weights: upstream's
modules are built and randomised, and ours load the same weights through our conversion. A voice prompt of
``--prompt-tokens`` tokens (and twice as many mel frames), ``--tokens`` new tokens (25 per second of audio),
``--steps`` Euler steps. One warm-up run is excluded; medians of ``--repeats`` runs are reported. ``--check``
also runs both on the same injected noise and reports the relative error of the mel and the waveform.
Peak memory is reported for the whole call and per stage (MLX's peak above the memory in use before it), under
``--memory-budget`` (``S3Gen.memory_budget``: auto, none, or MiB). ``--batch N`` also times N requests (the
voice prompt, tokens/2 .. tokens new tokens each) vocoded one by one and batched (``S3Gen.batch``): aggregate
RTF, speedup, peak memory and the largest relative waveform difference between the two.

    python benchmarks/bench_s3gen.py --systems ours,upstream --prompt-tokens 250 --tokens 250 --repeats 3 \
        --device gpu --torch-device cuda --check --out benchmarks/out/s3gen.jsonl
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
# Import our package before mlx.core: it preloads OpenBLAS and keeps fp32 matmuls in fp32 (see _backend.py).
import mlx_chatterbox  # noqa: F401  isort: skip
from mlx_chatterbox import _backend  # isort: skip

import argparse
import contextlib
import statistics
import time

import mlx.core as mx
import numpy as np
from common import bare_upstream, machine_info, memory_budget, refuse_torch_cpu_beside_preload, write_line

from mlx_chatterbox.convert import S3GEN_PARTS, sanitize_s3gen_part, split_s3gen
from mlx_chatterbox.generation.vocode import Draws, S3Gen, resolve_memory_budget
from mlx_chatterbox.generation.voice import Voice
from mlx_chatterbox.models import layers
from mlx_chatterbox.models.cfm import solve
from mlx_chatterbox.variants import ENGLISH

SAMPLE_RATE = 24000
TOKEN_SECONDS = 0.04
STAGE_PEAKS = ("encoder_peak_mib", "cfm_peak_mib", "hift_peak_mib")
# Ours, timed under each setting: (layers.FAST_CPU_MATH, the CFM estimator's dtype).
VARIANTS = {
    "default": (True, "float32"),
    "mlx-math": (False, "float32"),  # MLX's own exp/erf/tanh/attention on the CPU (ours are CPU-only)
    "bf16-cfm": (True, "bfloat16"),  # TTS.load(cfm_dtype="bfloat16"): the estimator in bf16
}


def build_upstream(torch, device):
    """Upstream's flow (encoder + CFM) and HiFT, with S3Token2Wav's constructor arguments (s3gen.py), built
    without s3gen.py itself, which needs torchaudio, librosa and s3tokenizer."""
    from chatterbox.models.s3gen.configs import CFM_PARAMS
    from chatterbox.models.s3gen.decoder import ConditionalDecoder
    from chatterbox.models.s3gen.f0_predictor import ConvRNNF0Predictor
    from chatterbox.models.s3gen.flow import CausalMaskedDiffWithXvec
    from chatterbox.models.s3gen.flow_matching import CausalConditionalCFM
    from chatterbox.models.s3gen.hifigan import HiFTGenerator
    from chatterbox.models.s3gen.transformer.upsample_encoder import UpsampleConformerEncoder

    torch.manual_seed(0)
    encoder = UpsampleConformerEncoder(
        output_size=512,
        attention_heads=8,
        linear_units=2048,
        num_blocks=6,
        dropout_rate=0.1,
        positional_dropout_rate=0.1,
        attention_dropout_rate=0.1,
        normalize_before=True,
        input_layer="linear",
        pos_enc_layer_type="rel_pos_espnet",
        selfattention_layer_type="rel_selfattn",
        input_size=512,
        use_cnn_module=False,
        macaron_style=False,
    )
    estimator = ConditionalDecoder(
        in_channels=320,
        out_channels=80,
        causal=True,
        channels=[256],
        dropout=0.0,
        attention_head_dim=64,
        n_blocks=4,
        num_mid_blocks=12,
        num_heads=8,
        act_fn="gelu",
    )
    decoder = CausalConditionalCFM(spk_emb_dim=80, cfm_params=CFM_PARAMS, estimator=estimator)
    flow = CausalMaskedDiffWithXvec(encoder=encoder, decoder=decoder)
    hift = HiFTGenerator(
        sampling_rate=SAMPLE_RATE,
        upsample_rates=[8, 5, 3],
        upsample_kernel_sizes=[16, 11, 7],
        source_resblock_kernel_sizes=[7, 7, 11],
        source_resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        f0_predictor=ConvRNNF0Predictor(),
    )
    with torch.no_grad():
        # Terms that default to identities (norm weights, zero biases, g = |v|) get random values.
        for module in (flow, hift):
            for name, p in module.named_parameters():
                if name.endswith("original0") or name.endswith("alpha"):
                    p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
                elif name.endswith(".bias") or "pos_bias" in name:
                    p.copy_(0.1 * torch.randn_like(p))
                elif "norm" in name and p.ndim == 1:
                    p.copy_(1 + 0.1 * torch.randn_like(p))
        hift.conv_post.bias.mul_(0.1)  # keep exp(magnitude) mostly below upstream's clip at 100
    return flow.to(device).eval(), hift.to(device).eval()


def ours_from(flow, hift) -> S3Gen:
    """Our S3Gen with upstream's weights, through our conversion of an ``s3gen.safetensors`` layout."""
    state = {f"flow.{k}": v for k, v in flow.state_dict().items()}
    state.update({f"mel2wav.{k}": v for k, v in hift.state_dict().items()})
    weights = {k: mx.array(v.detach().float().cpu().numpy()) for k, v in state.items()}
    parts = split_s3gen(weights)
    nets = {}
    for _, name, network in S3GEN_PARTS:
        if name in ("flow", "cfm", "hift"):  # the voice-cloning networks are not built here
            nets[name] = network(getattr(ENGLISH, name))
            nets[name].load_weights(
                list(sanitize_s3gen_part(parts[name], name, ENGLISH).items()), strict=True
            )
    mx.eval([n.parameters() for n in nets.values()])
    return S3Gen(nets["flow"], nets["cfm"], nets["hift"])


def fixed_inputs(prompt_tokens: int, tokens: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return dict(
        prompt_token=rng.integers(0, 6561, (1, prompt_tokens)),
        prompt_feat=rng.standard_normal((1, 2 * prompt_tokens, 80)).astype(np.float32) - 5,
        embedding=rng.standard_normal((1, 192)).astype(np.float32),
        token=rng.integers(0, 6561, (1, tokens)),
    )


def fixed_voice(inputs: dict[str, np.ndarray]) -> Voice:
    """The S3Gen prompt of ``fixed_inputs`` as a Voice (its T3 parts are unused by S3Gen)."""
    return Voice(
        speaker_emb=mx.zeros((1, 256)),
        t3_prompt_tokens=mx.zeros((1, 1), dtype=mx.int32),
        s3gen_prompt_tokens=mx.array(inputs["prompt_token"].astype(np.int32)),
        s3gen_prompt_mel=mx.array(inputs["prompt_feat"]),
        xvector=mx.array(inputs["embedding"]),
    )


def medians(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}


def bench_ours(s3gen: S3Gen, inputs: dict, steps: int, repeats: int, variant: str = "default") -> dict:
    layers.FAST_CPU_MATH, cfm_dtype = VARIANTS[variant]
    float32_weights = s3gen.estimator.parameters()
    s3gen.estimator.set_dtype(getattr(mx, cfm_dtype))
    voice = fixed_voice(inputs)
    tokens = mx.array(inputs["token"].astype(np.int32))
    everything = mx.concatenate([voice.s3gen_prompt_tokens, tokens], axis=1)
    lengths = mx.array([everything.shape[1]], dtype=mx.int32)

    def once() -> dict:
        key = mx.random.key(0)
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        mx.eval(s3gen(tokens, voice, cfm_steps=steps, key=key))
        t1 = time.perf_counter()
        peak = mx.get_peak_memory()
        # The stages apart (each evaluated on its own, so their sum exceeds the fused total slightly), each
        # under the call's memory budget; their peaks count from the memory in use before each stage.
        with stage_peak(s3gen) as encoder_peak:
            mu, mask = s3gen.flow.encode(everything, lengths)
            mx.eval(mu, mask)
        t2 = time.perf_counter()
        with stage_peak(s3gen) as cfm_peak:
            spks = s3gen.flow.embed_speaker(voice.xvector)
            cond = mx.zeros(mu.shape)
            mel = solve(
                s3gen.estimator, mu, mask, spks, cond, mx.random.normal(mu.shape, key=key), n_timesteps=steps
            )
            mx.eval(mel)
        t3 = time.perf_counter()
        with stage_peak(s3gen) as hift_peak:
            mx.eval(s3gen.hift(mel[:, voice.s3gen_prompt_mel.shape[1] :], key=key))
        t4 = time.perf_counter()
        return dict(
            total_ms=1e3 * (t1 - t0),
            encoder_ms=1e3 * (t2 - t1),
            cfm_ms=1e3 * (t3 - t2),
            hift_ms=1e3 * (t4 - t3),
            peak_mem_bytes=peak,
            encoder_peak_mib=encoder_peak[0] / 2**20,
            cfm_peak_mib=cfm_peak[0] / 2**20,
            hift_peak_mib=hift_peak[0] / 2**20,
        )

    once()
    result = medians([once() for _ in range(repeats)])
    result.update(
        variant=variant,
        peak_mem_kind="mx.get_peak_memory: whole call with the weights; stages above the memory before",
        memory_budget=s3gen.memory_budget,
        backend=_backend.STATUS,
    )
    layers.FAST_CPU_MATH, _ = VARIANTS["default"]
    s3gen.estimator.update(float32_weights)
    return result


@contextlib.contextmanager
def stage_peak(s3gen: S3Gen):
    """Yields a one-element list that receives MLX's peak above the memory in use at entry, with the memory
    limit that ``S3Gen`` calls run under (``bounded_memory``) in force meanwhile."""
    mx.synchronize()
    before, out = mx.get_active_memory(), [0]
    budget = resolve_memory_budget(s3gen.memory_budget)
    previous = mx.set_memory_limit(before + budget) if budget is not None else None
    mx.reset_peak_memory()
    try:
        yield out
    finally:
        if previous is not None:
            mx.set_memory_limit(previous)
        mx.synchronize()
        out[0] = mx.get_peak_memory() - before


def bench_batch(s3gen: S3Gen, inputs: dict, steps: int, repeats: int, n: int, bucket: int = 1) -> dict:
    """N requests (one voice, tokens/2 .. tokens new tokens, a key each) one by one and batched (rows padded
    to a multiple of ``bucket`` tokens)."""
    voice = fixed_voice(inputs)
    full = inputs["token"].shape[1]
    counts = np.linspace(max(1, full // 2), full, n).round().astype(int)
    rng = np.random.default_rng(2)
    ids = [mx.array(rng.integers(0, 6561, (1, c)).astype(np.int32)) for c in counts]
    voices, keys = [voice] * n, [mx.random.key(100 + i) for i in range(n)]

    def one_by_one() -> list[mx.array]:
        out = []
        for t, k in zip(ids, keys):
            out.append(s3gen(t, voice, cfm_steps=steps, key=k))
            mx.eval(out[-1])
        return out

    def batched() -> list[mx.array]:
        out = s3gen.batch(ids, voices, cfm_steps=steps, keys=keys, bucket=bucket)
        mx.eval(out)
        return out

    def timed(fn) -> tuple[float, float, list[mx.array]]:
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, (mx.get_peak_memory() - before) / 2**20, out

    timed(one_by_one), timed(batched)  # warm-up
    runs = [(timed(one_by_one), timed(batched)) for _ in range(repeats)]
    audio_s = float(counts.sum()) * TOKEN_SECONDS
    single_s = statistics.median(r[0][0] for r in runs)
    batch_s = statistics.median(r[1][0] for r in runs)
    (_, _, single), (_, _, together) = runs[-1]
    err = max(
        float(np.linalg.norm(np.array(b) - np.array(a)) / np.linalg.norm(np.array(a)))
        for a, b in zip(single, together)
    )
    return dict(
        requests=n,
        bucket=bucket,
        token_counts=counts.tolist(),
        audio_s=round(audio_s, 2),
        one_by_one_ms=round(1e3 * single_s, 1),
        batched_ms=round(1e3 * batch_s, 1),
        speedup=round(single_s / batch_s, 2),
        rtf_one_by_one=round(single_s / audio_s, 4),
        rtf_batched=round(batch_s / audio_s, 4),
        peak_one_by_one_mib=round(max(r[0][1] for r in runs)),
        peak_batched_mib=round(max(r[1][1] for r in runs)),
        wav_max_rel_err=err,
        memory_budget=s3gen.memory_budget,
    )


def upstream_mel(torch, flow, t: dict, steps: int):
    """Upstream ``CausalMaskedDiffWithXvec.inference`` as ``S3Token2Wav`` calls it (``finalize=True``)."""
    lengths = {k: torch.tensor([t[k].shape[1]], device=t[k].device) for k in ("token", "prompt_token")}
    mel, _ = flow.inference(
        token=t["token"],
        token_len=lengths["token"],
        prompt_token=t["prompt_token"],
        prompt_token_len=lengths["prompt_token"],
        prompt_feat=t["prompt_feat"],
        prompt_feat_len=None,
        embedding=t["embedding"],
        finalize=True,
        n_timesteps=steps,
    )
    return mel


def bench_upstream(torch, flow, hift, inputs: dict, steps: int, repeats: int, device) -> dict:
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    marks = {}

    def mark(name: str):
        def hook(*_) -> None:  # a hook's return value would replace the module's inputs or outputs
            sync()
            marks[name] = time.perf_counter()

        return hook

    flow.encoder.register_forward_pre_hook(mark("enc0"))
    flow.encoder.register_forward_hook(mark("enc1"))
    t = {k: torch.from_numpy(np.asarray(v)).to(device) for k, v in inputs.items()}

    def once() -> dict:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            mel = upstream_mel(torch, flow, t, steps)
            sync()
            t1 = time.perf_counter()
            wav, _ = hift.inference(speech_feat=mel, cache_source=torch.zeros(1, 1, 0, device=device))
            sync()
        t2 = time.perf_counter()
        encoder = marks["enc1"] - marks["enc0"]
        return dict(
            total_ms=1e3 * (t2 - t0),
            encoder_ms=1e3 * encoder,
            cfm_ms=1e3 * (t1 - t0 - encoder),
            hift_ms=1e3 * (t2 - t1),
        )

    once()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    result = medians([once() for _ in range(repeats)])
    result.update(
        peak_mem_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        torch_threads=torch.get_num_threads(),
    )
    return result


def check(torch, s3gen: S3Gen, flow, hift, inputs: dict, steps: int, device) -> dict:
    """Both systems on the same draws: upstream's torch.randn_like and SineGen phases return ours."""
    import chatterbox.models.s3gen.hifigan as hifigan_module

    total = 2 * (inputs["prompt_token"].shape[1] + inputs["token"].shape[1])
    rng = np.random.default_rng(1)
    draws = Draws(
        cfm_noise=mx.array(rng.standard_normal((1, total, 80)).astype(np.float32)),
        phases=mx.array(np.concatenate([[0.0], rng.uniform(-np.pi, np.pi, 8)])[None].astype(np.float32)),
        source_noise=mx.array(
            rng.standard_normal((1, 480 * (total - inputs["prompt_feat"].shape[1]), 9)).astype(np.float32)
        ),
    )
    by_shape = {
        (1, 80, total): np.array(draws.cfm_noise).transpose(0, 2, 1),
        (1, 9, draws.source_noise.shape[1]): np.array(draws.source_noise).transpose(0, 2, 1),
    }
    randn_like = torch.randn_like

    def injected_randn_like(x, *a, **k):
        ref = by_shape.get(tuple(x.shape))
        return randn_like(x, *a, **k) if ref is None else torch.from_numpy(ref).to(x.device, x.dtype)

    class Phases:
        def __init__(self, low, high):
            pass

        def sample(self, sample_shape):
            return torch.from_numpy(np.array(draws.phases)[..., None]).reshape(sample_shape)

    voice = fixed_voice(inputs)
    tokens = mx.array(inputs["token"].astype(np.int32))
    ours_mel = np.array(s3gen.mel(tokens, voice, cfm_steps=steps, cfm_noise=draws.cfm_noise))
    ours_wav = np.array(s3gen(tokens, voice, cfm_steps=steps, draws=draws))
    t = {k: torch.from_numpy(np.asarray(v)).to(device) for k, v in inputs.items()}
    torch.randn_like, uniform = injected_randn_like, hifigan_module.Uniform
    hifigan_module.Uniform = Phases
    try:
        with torch.inference_mode():
            mel = upstream_mel(torch, flow, t, steps)
            wav, _ = hift.inference(speech_feat=mel, cache_source=torch.zeros(1, 1, 0, device=device))
            wav[:, :960] *= torch.cat(
                [torch.zeros(480), (torch.cos(torch.linspace(torch.pi, 0, 480)) + 1) / 2]
            ).to(wav)
    finally:
        torch.randn_like, hifigan_module.Uniform = randn_like, uniform
    ref_mel = mel.cpu().numpy().transpose(0, 2, 1)
    ref_wav = wav.cpu().numpy()

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    return dict(mel_rel_err=rel(ours_mel, ref_mel), wav_rel_err=rel(ours_wav, ref_wav))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="ours,upstream", help="comma list of: ours, upstream")
    p.add_argument("--prompt-tokens", type=int, default=250, help="voice prompt tokens (250 = 10 s)")
    p.add_argument("--tokens", type=int, default=250, help="new speech tokens (25 per second of audio)")
    p.add_argument("--steps", type=int, default=10, help="CFM Euler steps")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up; medians are reported")
    p.add_argument("--device", choices=("cpu", "gpu"), help="MLX device (default: gpu when MLX has one)")
    p.add_argument("--torch-device", choices=("cpu", "cuda"), help="upstream device (default: cuda if any)")
    p.add_argument("--upstream-src", help="folder that holds upstream's 'chatterbox' package folder")
    p.add_argument(
        "--variants", default="default", help=f"ours, comma list of: {', '.join(VARIANTS)} (one row each)"
    )
    p.add_argument("--check", action="store_true", help="also compare outputs on injected noise")
    p.add_argument(
        "--memory-budget",
        default="auto",
        type=memory_budget,
        help="ours: S3Gen.memory_budget: auto, none, or MiB above the memory in use at a call's start",
    )
    p.add_argument("--batch", type=int, help="also time N requests (ours) one by one and batched")
    p.add_argument("--bucket", type=int, default=1, help="with --batch: rows padded to a multiple (tokens)")
    p.add_argument("--out", help="append the JSON lines to this file")
    args = p.parse_args(argv)
    systems = args.systems.split(",")
    if not set(systems) <= {"ours", "upstream"}:
        p.error("unknown system")
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        p.error(f"unknown variant in {args.variants!r}; choose from {', '.join(VARIANTS)}")

    if args.batch is not None and args.batch < 1:
        p.error(f"--batch {args.batch}: at least 1 request")

    import torch

    bare_upstream(args.upstream_src)
    device = torch.device(args.torch_device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if "upstream" in systems:
        refuse_torch_cpu_beside_preload(device.type)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # upstream fp32 numerics
        torch.backends.cudnn.allow_tf32 = False
    mlx_device = args.device or ("gpu" if mx.is_available(mx.gpu) else "cpu")
    mx.set_default_device(mx.gpu if mlx_device == "gpu" else mx.cpu)
    flow, hift = build_upstream(torch, device)
    s3gen = ours_from(flow, hift)
    s3gen.memory_budget = args.memory_budget
    inputs = fixed_inputs(args.prompt_tokens, args.tokens)
    audio_s = args.tokens * TOKEN_SECONDS
    info = machine_info()
    print(f"# MLX backend settings: {_backend.STATUS}", file=sys.stderr)
    rows = []
    runs = [(s, v) for s in systems for v in (variants if s == "ours" else ["-"])]
    for system, variant in runs:
        print(f"# {system} {variant} ...", file=sys.stderr)
        if system == "ours":
            res, dev = bench_ours(s3gen, inputs, args.steps, args.repeats, variant), mlx_device
        else:
            res, dev = bench_upstream(torch, flow, hift, inputs, args.steps, args.repeats, device), str(
                device
            )
        res.update(
            rtf=round(res["total_ms"] / 1e3 / audio_s, 4), cfm_step_ms=round(res["cfm_ms"] / args.steps, 2)
        )
        row = dict(system=system, device=dev, prompt_tokens=args.prompt_tokens, tokens=args.tokens)
        row.update(steps=args.steps, repeats=args.repeats, audio_s=audio_s, **res, **info)
        write_line(row, args.out)
        rows.append(row)
    if args.batch:
        print(f"# ours, {args.batch} requests one by one and batched ...", file=sys.stderr)
        res = bench_batch(s3gen, inputs, args.steps, args.repeats, args.batch, args.bucket)
        write_line(dict(system="ours-batch", device=mlx_device, steps=args.steps, **res, **info), args.out)
        print(
            f"# batch of {args.batch} ({res['audio_s']} s of audio): one by one {res['one_by_one_ms']} ms, "
            f"batched {res['batched_ms']} ms ({res['speedup']}x; RTF {res['rtf_one_by_one']} -> "
            f"{res['rtf_batched']}), peak {res['peak_one_by_one_mib']} -> {res['peak_batched_mib']} MiB, "
            f"max wav rel. err {res['wav_max_rel_err']:.1e}",
            file=sys.stderr,
        )
    if args.check:
        errors = check(torch, s3gen, flow, hift, inputs, args.steps, device)
        write_line(dict(system="check", **errors, **info), args.out)
        print(f"# ours vs upstream on the same draws: {errors}", file=sys.stderr)
    print(
        f"{'system':9} {'variant':15} {'device':7} {'total ms':>9} {'RTF':>7} {'encoder':>8} {'CFM':>8} {'CFM/step':>8} {'HiFT':>7} {'peak MiB':>8} "
        f"{'stage peaks MiB (enc/CFM/HiFT)':>30}",
        file=sys.stderr,
    )
    for r in rows:
        print(
            f"{r['system']:9} {r.get('variant', '-'):15} {r['device']:7} {r['total_ms']:>9.1f} {r['rtf']:>7.4f} {r['encoder_ms']:>8.1f} "
            f"{r['cfm_ms']:>8.1f} {r['cfm_step_ms']:>8.2f} {r['hift_ms']:>7.1f} "
            f"{(r['peak_mem_bytes'] or 0) / 2**20:>8.0f} "
            f"{'/'.join(str(round(r[k])) for k in STAGE_PEAKS if k in r):>30}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
