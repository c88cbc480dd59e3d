"""The upstream oracle: builds upstream chatterbox-tts 0.1.7 modules with random weights, writes them in the
exact upstream file layout, and runs them. The only test module (with test_torchfile) that imports torch.

Every term that could hide as an identity (norm weights, biases, the perceiver query) is randomised.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
from chatterbox.models.s3gen.flow import CausalMaskedDiffWithXvec
from chatterbox.models.s3gen.transformer.attention import RelPositionMultiHeadedAttention
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
    logits, cache = model.prefill(prefill_embeds(model, ours_cond, text, 0.5))
    ours = [logits]
    for i, tok in enumerate(feed):
        logits, cache.kv = model.decode(
            mx.array([tok, tok]), mx.array(i + 1), mx.array(cache.claim()), cache.kv
        )
        ours.append(logits)
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


# --- S3Gen: randomisers for upstream modules of any size ---


def upstream_s3gen(seed: int = 0):
    """Upstream's full-size ``S3Token2Wav`` (flow, CFM, HiFT, S3 tokenizer, CAM++), every network randomised,
    in eval mode, fp32."""
    from chatterbox.models.s3gen import S3Gen  # imports torchaudio and s3tokenizer: only where needed

    torch.manual_seed(seed)
    model = S3Gen().eval()
    randomize_flow_(model.flow, seed + 1)
    randomize_cfm_(model.flow.decoder, seed + 2)
    randomize_hift_(model.mel2wav, seed + 3)
    randomize_s3tokenizer_(model.tokenizer, seed + 4)
    randomize_campplus_(model.speaker_encoder, seed + 5)
    return model


def write_s3gen_checkpoint(model: torch.nn.Module, folder: Path) -> Path:
    """``s3gen.safetensors`` as upstream ships it: the state dict without the tokenizer's front-end buffers
    (``S3Token2Wav.ignore_state_dict_missing``)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "s3gen.safetensors"
    state = {
        k: v.contiguous() for k, v in model.state_dict().items() if k not in model.ignore_state_dict_missing
    }
    save_file(state, str(path))
    return path


def randomize_flow_(module: torch.nn.Module, seed: int) -> None:
    """Move every term of an upstream flow front that could hide as an identity away from its initialisation,
    in place: LayerNorm weight 1 + 0.1·N and bias 0.1·N, every Linear/Conv1d bias 0.1·N, pos_bias_u/v 0.2·N.
    ``module`` is a ``CausalMaskedDiffWithXvec`` (its ``decoder`` is left alone: the CFM has its own) or an
    ``UpsampleConformerEncoder``. Weights keep upstream's initialisation, which keeps activations O(1)."""
    g = torch.Generator().manual_seed(seed)

    def normal(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=g, dtype=t.dtype)

    if isinstance(module, CausalMaskedDiffWithXvec):
        parts = [module.input_embedding, module.spk_embed_affine_layer, module.encoder, module.encoder_proj]
    else:
        parts = [module]
    with torch.no_grad():
        for part in parts:
            for m in part.modules():
                if isinstance(m, torch.nn.LayerNorm):
                    m.weight.copy_(1 + 0.1 * normal(m.weight))
                    m.bias.copy_(0.1 * normal(m.bias))
                elif isinstance(m, (torch.nn.Linear, torch.nn.Conv1d)) and m.bias is not None:
                    m.bias.copy_(0.1 * normal(m.bias))
                elif isinstance(m, RelPositionMultiHeadedAttention):
                    m.pos_bias_u.copy_(0.2 * normal(m.pos_bias_u))
                    m.pos_bias_v.copy_(0.2 * normal(m.pos_bias_v))


def randomize_cfm_(module: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter of an upstream ``ConditionalDecoder`` (or a module holding one, such as
    ``CausalConditionalCFM``) of any size, in place: Kaiming-normal weights as upstream initialises them,
    biases 0.1·N, LayerNorm weights 1 + 0.1·N. The residual branches are scaled down (res_conv x 0.7,
    attention and feed-forward outputs x 0.5) so that the stream grows ~7x over the 14 stages instead of
    ~500x, which would leave the early blocks invisible in the output."""
    g = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(mean + std * torch.randn(p.shape, generator=g, dtype=p.dtype))

    with torch.no_grad():
        for name, mod in module.named_modules():
            if isinstance(mod, torch.nn.LayerNorm):
                normal(mod.weight, 0.1, mean=1.0)
                normal(mod.bias, 0.1)
            elif isinstance(mod, (torch.nn.Linear, torch.nn.Conv1d)):
                scale = 1.0
                if name.endswith("res_conv"):
                    scale = 0.7
                elif name.endswith(("to_out.0", "ff.net.2")):
                    scale = 0.5
                normal(mod.weight, scale * (2.0 / mod.weight[0].numel()) ** 0.5)
                if mod.bias is not None:
                    normal(mod.bias, 0.1)


def randomize_hift_(module: torch.nn.Module, seed: int) -> None:
    """Randomise an upstream ``HiFTGenerator`` (``S3Token2Wav.mel2wav``, any size) in place: weight-norm
    g = ‖v‖·U(0.5, 1.5), biases 0.1·N, Snake α U(0.5, 1.5). The F0 classifier is scaled so that f0 lands
    around 100 Hz with a few unvoiced (< 10 Hz) frames, and conv_post is scaled up to a log-magnitude
    spread of about ±1, well under upstream's clip at exp(4.6) = 100."""
    g = torch.Generator().manual_seed(seed)
    params = dict(module.named_parameters())

    def uniform(p: torch.Tensor, low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(p.shape, generator=g)

    with torch.no_grad():
        for name, p in params.items():
            if name.endswith("parametrizations.weight.original0"):
                v = params[name[:-1] + "1"]
                norm = v.flatten(1).norm(dim=1).reshape(p.shape)
                p.copy_(norm * uniform(p, 0.5, 1.5))
            elif name.endswith(".alpha"):
                p.copy_(uniform(p, 0.5, 1.5))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        classifier = module.f0_predictor.classifier
        classifier.weight.mul_(3000.0 / classifier.weight.norm())
        classifier.bias.fill_(30.0)
        module.conv_post.parametrizations.weight.original0.mul_(5.0)


def randomize_s3tokenizer_(module: torch.nn.Module, seed: int) -> None:
    """Randomise, in place, every term of an upstream S3TokenizerV2 (any size) that could hide as an identity.

    LayerNorm weights 1 + 0.1·N and all biases 0.1·N; the FSMN depthwise kernels N(0, 1/k); ``project_down``
    N(0, 1/n_state), which with the encoder's O(1) hidden states spreads the pre-tanh values over about ±1 so that
    every FSQ digit takes all three levels. Other weights keep their (random) initialisation.
    """
    g = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor) -> torch.Tensor:
        return torch.randn(p.shape, generator=g, dtype=p.dtype)

    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("_ln.weight"):
                p.copy_(1 + 0.1 * normal(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * normal(p))
            elif name.endswith("fsmn_block.weight"):
                p.copy_(normal(p) / p.shape[-1] ** 0.5)
            elif name.endswith("project_down.weight"):
                p.copy_(normal(p) / p.shape[1] ** 0.5)


def randomize_campplus_(module: torch.nn.Module, seed: int) -> None:
    """Move every BatchNorm and conv bias of an upstream CAM++ (or any part of one) away from its identity
    initialisation, in place: BN weight 1 + 0.1·N, bias 0.1·N, running_mean 0.1·N, running_var U(0.5, 1.5);
    conv biases 0.1·N. Conv weights keep upstream's (Kaiming) initialisation, which keeps activations O(1)."""
    g = torch.Generator().manual_seed(seed)

    def normal(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=g, dtype=t.dtype)

    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                if m.affine:
                    m.weight.copy_(1 + 0.1 * normal(m.weight))
                    m.bias.copy_(0.1 * normal(m.bias))
                m.running_mean.copy_(0.1 * normal(m.running_mean))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
            elif isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d)) and m.bias is not None:
                m.bias.copy_(0.1 * normal(m.bias))


def randomize_voice_encoder_(module: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter of an upstream ``VoiceEncoder`` (any size) in place: weights uniform in PyTorch's
    init range, biases (b_ih and b_hh independently) 0.1·N, the unused similarity scale/offset perturbed."""
    g = torch.Generator().manual_seed(seed)
    hidden = module.lstm.hidden_size
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith("lstm.weight"):
                bound = 1 / math.sqrt(hidden)
                p.copy_((2 * torch.rand(p.shape, generator=g) - 1) * bound)
            elif name == "proj.weight":
                bound = 1 / math.sqrt(p.shape[1])
                p.copy_((2 * torch.rand(p.shape, generator=g) - 1) * bound)
            elif name.startswith("similarity"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            else:  # LSTM and proj biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def write_ve_checkpoint(folder: Path, seed: int = 0) -> Path:
    """``ve.safetensors`` from upstream's full-size ``VoiceEncoder``, randomised."""
    from chatterbox.models.voice_encoder import VoiceEncoder

    torch.manual_seed(seed)
    model = VoiceEncoder().eval()
    randomize_voice_encoder_(model, seed)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ve.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def ours_from(upstream: torch.nn.Module, network: type, cfg, drop: tuple[str, ...] = ()):
    """Our ``network(cfg)`` holding ``upstream``'s weights, through our conversion (``sanitize`` with the
    network's key table: renames, weight-norm folding, layouts), loaded strictly. ``drop`` lists upstream buffers
    that conversion drops before sanitizing (the S3 tokenizer's front-end buffers)."""
    from mlx_chatterbox.convert import sanitize

    weights = {k: mx.array(v.detach().numpy()) for k, v in upstream.state_dict().items() if k not in drop}
    model = network(cfg)
    model.load_weights(list(sanitize(weights, network.checkpoint_table(cfg), "test").items()), strict=True)
    return model


@contextlib.contextmanager
def injected_multinomial_tie_safe(uniforms: np.ndarray, ours: list[float], margin: float = 1e-6):
    """``injected_multinomial(uniforms)``, and ``ours`` receives, draw by draw, the uniform that makes our
    sampler pick the same id: the same u, except where u lies within ``margin`` of an end of the picked id's
    (normalised) CDF interval. There the two fp32 CDFs (torch's and ours, each within ~1e-7) may fall on
    either side, and even upstream's own pick can change from run to run; ``ours`` gets the interval's
    midpoint instead, so that a token differs only when the distributions really differ."""
    original = torch.multinomial
    it = iter(uniforms.tolist())

    def fake(probs, num_samples=1, **_):
        assert num_samples == 1 and probs.shape[0] == 1
        cdf = probs.cumsum(dim=-1)
        u = next(it)
        picked = (cdf <= u * cdf[:, -1:]).sum(dim=-1, keepdim=True).clamp(max=probs.shape[-1] - 1)
        k = int(picked)
        edges = (cdf[0].double() / cdf[0, -1].double()).tolist()
        low, high = (edges[k - 1] if k > 0 else 0.0), edges[k]
        ours.append((low + high) / 2 if min(u - low, high - u) < margin else u)
        return picked

    torch.multinomial = fake
    try:
        yield
    finally:
        torch.multinomial = original
