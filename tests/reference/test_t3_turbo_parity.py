"""Turbo/Nano T3 parity with upstream chatterbox-tts 0.1.7 on random weights, fp32.

Upstream ``T3(hp)`` is built as ``ChatterboxTurboTTS.from_local`` builds it (variants.md §2.2); Nano registers
HEAD's ``GPT2_small`` into 0.1.7's ``LLAMA_CONFIGS`` (§4). Its state dict is written as a safetensors file,
goes through *our* ``sanitize`` and a strict load into *our* ``T3Turbo``.
Tolerances: logits and embeddings max |ours - ref| / max |ref| < 1e-4; processed probabilities within 1e-6
absolute with the same support; sampled tokens (injected uniforms) exactly equal.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
import torch
from chatterbox.models.t3 import T3 as UpstreamT3
from chatterbox.models.t3.llama_configs import GPT2_MEDIUM_CONFIG, LLAMA_CONFIGS
from chatterbox.models.t3.modules.cond_enc import T3Cond as UpstreamT3Cond
from chatterbox.models.t3.modules.t3_config import T3Config as UpstreamT3Config
from safetensors.torch import save_file
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mlx_chatterbox import sampling
from mlx_chatterbox.convert import sanitize
from mlx_chatterbox.generation.turbo import generate_turbo_tokens, postprocess_tokens
from mlx_chatterbox.models.gpt2 import NANO, TURBO, T3Turbo, T3TurboConfig
from mlx_chatterbox.sampling import TurboParams, process_turbo_logits, softmax
from tests.conftest import assert_same_ids_kept, random_voice

from . import oracle

pytestmark = pytest.mark.reference

logging.getLogger("chatterbox").setLevel(logging.WARNING)

TOL = 1e-4
# Processed probabilities, max abs diff: our exp and sum, and MLX's (run here on the CPU, whose MLX exp is off by
# up to ~4e-6; a GPU's within a few ulps).
PROB_TOL = {"ours": 1e-6, "mlx": 1e-5}
START, STOP = 6561, 6562
TEXT = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13, 50257, 220]  # GPT-2 ids (+ a tag id)
TINY = T3TurboConfig(hidden_size=64, num_layers=2, num_heads=4, n_positions=512, text_vocab_size=50276)
STEPS = 5  # cached decode steps compared at full size


# --- upstream, driven as tts_turbo.py drives it ---


def config_name(cfg: T3TurboConfig) -> str:
    """The ``LLAMA_CONFIGS`` entry for ``cfg``, registered when 0.1.7 lacks it (Nano, test sizes)."""
    if cfg == TURBO:
        return "GPT2_medium"
    # HEAD 5de7a54's GPT2_SMALL_CONFIG is GPT2_MEDIUM_CONFIG with 768 / 12 / 12 (variants.md §4).
    name = "GPT2_small" if cfg == NANO else f"test_gpt2_{cfg.hidden_size}_{cfg.num_layers}_{cfg.num_heads}"
    LLAMA_CONFIGS[name] = dict(
        GPT2_MEDIUM_CONFIG,
        n_embd=cfg.hidden_size,
        hidden_size=cfg.hidden_size,
        n_layer=cfg.num_layers,
        n_head=cfg.num_heads,
        n_positions=cfg.n_positions,
        n_ctx=cfg.n_positions,
        vocab_size=cfg.text_vocab_size,
    )
    return name


def upstream_turbo(cfg: T3TurboConfig, seed: int) -> UpstreamT3:
    """Upstream T3 with Turbo's hp at ``cfg``'s sizes, every weight random (LayerNorm and biases included),
    eval mode, fp32."""
    torch.manual_seed(seed)
    hp = UpstreamT3Config(text_tokens_dict_size=cfg.text_vocab_size)
    hp.llama_config_name = config_name(cfg)
    hp.speech_tokens_dict_size = 6563
    hp.input_pos_emb = None
    hp.speech_cond_prompt_len = 375
    hp.use_perceiver_resampler = False
    hp.emotion_adv = False
    # Built without storage and then filled once: transformers' own init of 400M weights would only be
    # overwritten (and took much of this file's time). T3 with these hp registers no buffers.
    with torch.device("meta"):
        model = UpstreamT3(hp)
    assert not list(model.named_buffers())
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("wpe.weight"):
                p.copy_(0.3 * torch.randn_like(p))  # init's 0.02 would leave positions a faint signal
            elif p.ndim == 2 and "emb" not in name:
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p))  # embedding tables, as nn.Embedding's init
    return model.eval()


def ours_from(upstream: UpstreamT3, cfg: T3TurboConfig, folder) -> T3Turbo:
    """Upstream's state dict -> ``t3_turbo_v1.safetensors`` -> our sanitize -> our strict load."""
    path = folder / "t3_turbo_v1.safetensors"
    save_file({k: v.contiguous() for k, v in upstream.state_dict().items()}, str(path))
    model = T3Turbo(cfg)
    weights = sanitize(mx.load(str(path)), T3Turbo.checkpoint_table(cfg), path.name)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def upstream_cond(voice) -> UpstreamT3Cond:
    return UpstreamT3Cond(
        speaker_emb=torch.from_numpy(np.array(voice.speaker_emb)),
        cond_prompt_speech_tokens=torch.from_numpy(np.array(voice.t3_prompt_tokens)).long(),
        emotion_adv=0.5 * torch.ones(1, 1, 1),  # unused: hp.emotion_adv is False
    )


@torch.inference_mode()
def upstream_teacher_forced(model: UpstreamT3, voice, text: list[int], feed: list[int]):
    """Upstream's prefill embeddings and the speech logits (1, V) of the prefill and of each cached step that
    feeds ``feed[i]``, along ``inference_turbo``'s own path (tfmr with past_key_values, then speech_head)."""
    start = torch.tensor([[START]])
    embeds, _ = model.prepare_input_embeds(
        t3_cond=upstream_cond(voice), text_tokens=torch.tensor([text]), speech_tokens=start, cfg_weight=0.0
    )
    out = model.tfmr(inputs_embeds=embeds, use_cache=True)
    logits = [model.speech_head(out[0][:, -1:])[:, -1]]
    past = out.past_key_values
    for tok in feed:
        out = model.tfmr(
            inputs_embeds=model.speech_emb(torch.tensor([[tok]])), past_key_values=past, use_cache=True
        )
        past = out.past_key_values
        logits.append(model.speech_head(out[0])[:, -1])
    return embeds.numpy(), [x.numpy() for x in logits]


def ours_teacher_forced(model: T3Turbo, voice, text: list[int], feed: list[int]):
    embeds = model.prepare_input_embeds(voice.speaker_emb, voice.t3_prompt_tokens, mx.array([text]))
    logits, cache = model.prefill(embeds)
    out = [logits]
    for tok in feed:
        logits, cache.kv = model.decode(mx.array([tok]), mx.array(cache.claim(), dtype=mx.int32), cache.kv)
        out.append(logits)
    return np.array(embeds), [np.array(x) for x in out]


def upstream_processors(p: TurboParams) -> LogitsProcessorList:
    """``inference_turbo``'s processor list, built under its conditions and in its order."""
    procs = LogitsProcessorList()
    if p.temperature > 0 and p.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k > 0:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        procs.append(TopPLogitsWarper(p.top_p))
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    return procs


def run_full(cfg: T3TurboConfig, seed: int, tmp_path_factory) -> dict:
    """Everything the full-size tests compare, computed once; both models are released afterwards."""
    upstream = upstream_turbo(cfg, seed)
    ours = ours_from(upstream, cfg, tmp_path_factory.mktemp("upstream"))
    voice = random_voice(seed=seed, prompt_len=30)
    feed = np.random.default_rng(seed).integers(0, 6563, STEPS).tolist()
    ref_embeds, ref_logits = upstream_teacher_forced(upstream, voice, TEXT, feed)
    our_embeds, our_logits = ours_teacher_forced(ours, voice, TEXT, feed)
    return dict(
        feed=feed, ref_embeds=ref_embeds, our_embeds=our_embeds, ref_logits=ref_logits, our_logits=our_logits
    )


@pytest.fixture(scope="module")
def turbo(tmp_path_factory):
    return run_full(TURBO, 1, tmp_path_factory)


@pytest.fixture(scope="module")
def nano(tmp_path_factory):
    return run_full(NANO, 2, tmp_path_factory)


# --- (a), (b): the network at full size ---


@pytest.mark.parametrize("size", ["turbo", "nano"])
def test_prefill_embeds_and_cached_decode_logits_full_size(size, request):
    run = request.getfixturevalue(size)
    assert (
        run["our_embeds"].shape
        == run["ref_embeds"].shape
        == (1, 1 + 30 + len(TEXT) + 1, run["our_embeds"].shape[2])
    )
    err_embeds = oracle.rel_err(run["our_embeds"], run["ref_embeds"])
    errors = [oracle.rel_err(o, r) for o, r in zip(run["our_logits"], run["ref_logits"])]
    print(
        f"{size}: prefill embeds rel err {err_embeds:.1e}; prefill + {STEPS} steps logits {max(errors):.2e}"
    )
    assert err_embeds < TOL
    assert len(errors) == 1 + STEPS and max(errors) < TOL


# --- (c): the processed probabilities against transformers' processors ---

KNOBS = [
    {},  # upstream defaults: T 0.8, top_k 1000, top_p 0.95, penalty 1.2
    dict(temperature=1.3, top_k=50, top_p=0.8, repetition_penalty=2.0),
    dict(temperature=0.0, top_k=10000, top_p=1.0, repetition_penalty=1.5),  # T = 0: no scaling; k > V
    dict(temperature=0.5, top_k=0, top_p=0.5, repetition_penalty=1.0),
]


@pytest.mark.parametrize("knobs", KNOBS)
@pytest.mark.parametrize("scale", [1.0, 8.0])  # the random model's flat logits, and a peaked version
@pytest.mark.parametrize("math", ["ours", "mlx"])  # our exp and sum (the CPU's chain), or MLX's (a GPU's)
def test_processed_probabilities_match_upstreams_processors(turbo, knobs, scale, math, monkeypatch):
    monkeypatch.setattr(sampling, "mlx_math", lambda: math == "mlx")
    p = TurboParams(**knobs)
    procs = upstream_processors(p)
    # Step 0 sees [start]; step i the generated ids so far (here the fed ones, with a repeat and an EOS).
    generated = [turbo["feed"][0], 17, 17, STOP] + turbo["feed"][1:]
    worst = 0.0
    for i, logits in enumerate(turbo["ref_logits"]):
        history = [START] if i == 0 else generated[: i + 3]
        x = (scale * logits).astype(np.float32)
        ref = torch.softmax(procs(torch.tensor([history]), torch.from_numpy(x)), dim=-1).numpy()
        seen = mx.array(np.isin(np.arange(x.shape[1]), history)[None])
        ours = np.array(softmax(process_turbo_logits(mx.array(x), seen, p)))
        assert_same_ids_kept(ours, ref, math)
        worst = max(worst, float(np.abs(ours - ref).max()))
    print(f"processed probabilities {knobs} x{scale} {math}: max abs diff {worst:.1e}")
    assert worst < PROB_TOL[math]


# --- (d): end to end with injected draws ---


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    upstream = upstream_turbo(TINY, 3)
    return (
        upstream,
        ours_from(upstream, TINY, tmp_path_factory.mktemp("tiny")),
        random_voice(seed=4, prompt_len=40),
    )


@torch.inference_mode()
def upstream_tokens(model: UpstreamT3, voice, p: TurboParams, uniforms: np.ndarray) -> list[int]:
    with oracle.injected_multinomial(uniforms):
        out = model.inference_turbo(
            upstream_cond(voice),
            torch.tensor([TEXT]),
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            repetition_penalty=p.repetition_penalty,
            max_gen_len=p.max_new_tokens,
        )
    return out[0].tolist()


@pytest.mark.parametrize("stop_bias", [0.0, 5.0, 40.0])  # no EOS / a later EOS / an EOS as the first token
@pytest.mark.parametrize("knobs", KNOBS[:3])
def test_sampled_tokens_equal_upstream_inference_turbo(tiny, stop_bias, knobs):
    upstream, ours, voice = tiny
    with torch.no_grad():
        bias = upstream.speech_head.bias.clone()
        upstream.speech_head.bias[STOP] += stop_bias
    ours.update({"speech_head": {"bias": mx.array(upstream.speech_head.bias.detach().numpy())}})
    try:
        p = TurboParams(max_new_tokens=40, **knobs)
        uniforms = np.random.default_rng(5).random(1 + p.max_new_tokens).astype(np.float32)
        ref = upstream_tokens(upstream, voice, p, uniforms)
        raw = list(generate_turbo_tokens(ours, voice, TEXT, p, uniforms=mx.array(uniforms)))
    finally:
        with torch.no_grad():
            upstream.speech_head.bias.copy_(bias)
        ours.update({"speech_head": {"bias": mx.array(bias.numpy())}})
    # Upstream drops a final EOS; we yield it.
    assert (raw[:-1] if raw[-1] == STOP else raw) == ref
    if stop_bias == 0.0:
        assert len(raw) == 1 + p.max_new_tokens and len(set(raw)) > 10
    elif stop_bias == 5.0:
        assert STOP in raw[1:] and len(raw) < 1 + p.max_new_tokens
    elif stop_bias == 40.0:
        assert raw == [STOP, STOP]  # the first EOS is not a stop (variants.md §2.8)
    assert postprocess_tokens(raw) == [t for t in ref if t < 6561] + [4299] * 3
