"""The upstream oracle: builds upstream chatterbox-tts 0.1.7 modules with random weights, writes them in the
exact upstream file layout, and runs them. The only test module (with test_torchfile) that imports torch.

Every term that could hide as an identity (norm weights, biases, the perceiver query) is randomised.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np
import torch
from chatterbox.models.t3 import T3 as UpstreamT3
from chatterbox.models.t3.llama_configs import LLAMA_520M_CONFIG_DICT, LLAMA_CONFIGS
from chatterbox.models.t3.modules.cond_enc import T3Cond as UpstreamT3Cond
from chatterbox.models.t3.modules.perceiver import Perceiver as UpstreamPerceiver
from chatterbox.models.t3.modules.t3_config import T3Config as UpstreamT3Config
from safetensors.torch import save_file

from mlx_chatterbox.models.t3 import T3Config

# Upstream T3 logs an INFO line at EOS and tqdm-wraps its loop; keep test output readable.
logging.getLogger("chatterbox").setLevel(logging.WARNING)

TINY = T3Config(hidden_size=64, num_layers=2, num_heads=4, head_dim=16, intermediate_size=128)
FULL = T3Config()


def upstream_t3(cfg: T3Config, seed: int = 0) -> UpstreamT3:
    """An upstream T3 of ``cfg``'s sizes with randomised weights, in eval mode, fp32."""
    torch.manual_seed(seed)
    name = "Llama_520M"
    if cfg != FULL:
        name = (
            f"test_{cfg.hidden_size}_{cfg.num_layers}_{cfg.num_heads}_{cfg.head_dim}_{cfg.intermediate_size}"
        )
        LLAMA_CONFIGS[name] = dict(
            LLAMA_520M_CONFIG_DICT,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_heads,
            head_dim=cfg.head_dim,
        )
    hp = UpstreamT3Config(text_tokens_dict_size=cfg.text_vocab_size)
    hp.llama_config_name = name
    hp.max_text_tokens, hp.max_speech_tokens = cfg.max_text_tokens, cfg.max_speech_tokens
    model = UpstreamT3(hp)
    if cfg.hidden_size != 1024:
        # Upstream's Perceiver is hard-wired to 1024 channels; build it at the test size.
        model.cond_enc.perceiver = UpstreamPerceiver(
            cfg.perceiver_queries, cfg.hidden_size, cfg.hidden_size, cfg.perceiver_heads
        )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def write_t3_checkpoint(model: UpstreamT3, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "t3_cfg.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def random_conds(cfg: T3Config, seed: int = 0, prompt_len: int = 150, gen_tokens: int = 40):
    """A built-in voice like upstream's ``conds.pt`` (a ``chatterbox.tts.Conditionals``), random contents."""
    from chatterbox.tts import Conditionals  # the whole TTS stack (librosa, perth): only where needed

    g = torch.Generator().manual_seed(seed)
    t3 = UpstreamT3Cond(
        speaker_emb=torch.randn(1, cfg.speaker_embed_size, generator=g),
        cond_prompt_speech_tokens=torch.randint(0, 6561, (1, prompt_len), generator=g),
        emotion_adv=0.5 * torch.ones(1, 1, 1),
    )
    gen = dict(
        prompt_token=torch.randint(0, 6561, (1, gen_tokens), generator=g),
        prompt_token_len=torch.tensor([gen_tokens]),
        prompt_feat=torch.randn(1, 2 * gen_tokens, 80, generator=g),
        prompt_feat_len=None,
        embedding=torch.randn(1, 192, generator=g),
    )
    return Conditionals(t3, gen)


def upstream_cond(conds, exaggeration: float) -> UpstreamT3Cond:
    """A fresh T3Cond (upstream mutates it to cache the prompt embedding) with ``exaggeration``."""
    c = conds.t3
    return UpstreamT3Cond(
        speaker_emb=c.speaker_emb,
        cond_prompt_speech_tokens=c.cond_prompt_speech_tokens,
        emotion_adv=exaggeration * torch.ones(1, 1, 1),
    )


@torch.inference_mode()
def cond_embeds(model: UpstreamT3, cond: UpstreamT3Cond) -> np.ndarray:
    return model.prepare_conditioning(cond).numpy()


@torch.inference_mode()
def prefill_embeds(
    model: UpstreamT3, cond: UpstreamT3Cond, text: list[int], cfg_weight: float
) -> torch.Tensor:
    """Upstream's prefill as ``T3.inference`` builds it: prepare_input_embeds + the second BOS."""
    hp = model.hp
    row = [hp.start_text_token, *text, hp.stop_text_token]
    tokens = torch.tensor([row, row] if cfg_weight > 0 else [row])
    bos = torch.full((tokens.shape[0], 1), hp.start_speech_token)
    embeds, _ = model.prepare_input_embeds(
        t3_cond=cond, text_tokens=tokens, speech_tokens=bos, cfg_weight=cfg_weight
    )
    bos_embed = model.speech_emb(bos[:1]) + model.speech_pos_emb.get_fixed_embedding(0)
    return torch.cat([embeds, bos_embed.expand(tokens.shape[0], -1, -1)], dim=1)


@torch.inference_mode()
def teacher_forced_logits(
    model: UpstreamT3, cond: UpstreamT3Cond, text: list[int], feed: list[int], cfg_weight: float = 0.5
) -> list[np.ndarray]:
    """Backbone speech logits (B, V) of the prefill and of each cached step that feeds ``feed[i]`` at speech
    position i + 1, through upstream's own HF backend and KV cache (the path ``T3.inference`` takes)."""
    from chatterbox.models.t3.inference.t3_hf_backend import T3HuggingfaceBackend

    backend = T3HuggingfaceBackend(
        model.cfg, model.tfmr, speech_enc=model.speech_emb, speech_head=model.speech_head
    )
    embeds = prefill_embeds(model, cond, text, cfg_weight)
    out = backend(inputs_embeds=embeds, past_key_values=None, use_cache=True, output_hidden_states=True)
    logits = [out.logits[:, -1].numpy()]
    past = out.past_key_values
    for i, tok in enumerate(feed):
        emb = model.speech_emb(torch.tensor([[tok]])) + model.speech_pos_emb.get_fixed_embedding(i + 1)
        out = backend(
            inputs_embeds=emb.expand(embeds.shape[0], -1, -1), past_key_values=past, output_hidden_states=True
        )
        past = out.past_key_values
        logits.append(out.logits[:, -1].numpy())
    return logits


def compare_teacher_forced(
    upstream: UpstreamT3, cond: UpstreamT3Cond, model, voice, text: list[int], steps: int, seed: int
) -> list[float]:
    """Relative errors of our logits (prefill, then ``steps`` cached steps feeding random ids) against
    upstream's, for an upstream T3 and our T3 holding the same weights."""
    import mlx.core as mx

    from mlx_chatterbox.generation.speech_tokens import prefill_embeds
    from mlx_chatterbox.models.t3 import T3Cond

    feed = np.random.default_rng(seed).integers(0, 6561, steps).tolist()
    ref = teacher_forced_logits(upstream, cond, text, feed)
    ours_cond = T3Cond(voice.speaker_emb, voice.t3_prompt_tokens, float(cond.emotion_adv.flatten()[0]))
    cache = model.make_cache()
    ours = [model.step(prefill_embeds(model, ours_cond, text, 0.5), cache)]
    for i, tok in enumerate(feed):
        ours.append(model.step(model.embed_speech(mx.array([[tok], [tok]]), start=i + 1), cache))
    return [rel_err(o, r) for o, r in zip(ours, ref)]


@contextlib.contextmanager
def injected_multinomial(uniforms: np.ndarray | None):
    """Replace ``torch.multinomial`` for the duration: arg-max when ``uniforms`` is None, else the inverse-CDF
    draw ``min{i : cdf_i > u * cdf_last}`` with the next uniform, as ``mlx_chatterbox.sampling.draw`` does."""
    original = torch.multinomial
    it = iter([] if uniforms is None else uniforms.tolist())

    def fake(probs, num_samples=1, **_):
        assert num_samples == 1
        if uniforms is None:
            return probs.argmax(dim=-1, keepdim=True)
        cdf = probs.cumsum(dim=-1)
        u = next(it)
        return (cdf <= u * cdf[:, -1:]).sum(dim=-1, keepdim=True).clamp(max=probs.shape[-1] - 1)

    torch.multinomial = fake
    try:
        yield
    finally:
        torch.multinomial = original


@torch.inference_mode()
def upstream_inference(
    model: UpstreamT3,
    cond: UpstreamT3Cond,
    text: list[int],
    max_new_tokens: int,
    uniforms: np.ndarray | None,
    **knobs,
) -> list[int]:
    """Upstream ``T3.inference`` as ``ChatterboxTTS.generate`` calls it, with the draws injected."""
    hp = model.hp
    row = [hp.start_text_token, *text, hp.stop_text_token]
    tokens = torch.tensor([row, row])
    with injected_multinomial(uniforms):
        out = model.inference(t3_cond=cond, text_tokens=tokens, max_new_tokens=max_new_tokens, **knobs)
    return out[0].tolist()


def rel_err(ours, ref) -> float:
    """max |ours - ref| / max |ref|."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def rel_l2(ours, ref) -> float:
    """||ours - ref|| / ||ref|| (Frobenius), in float64."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
