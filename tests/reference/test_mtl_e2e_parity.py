"""Multilingual end to end, text -> waveform: ours against upstream ``ChatterboxMultilingualTTS.generate``,
before the watermark, for v2 (upstream 0.1.7, the alignment analyzer on), v3 (upstream HEAD 3f35dfc, built
from 0.1.7 by HEAD's three differences, below) and two of the Single Language Pack (pt-br, zh-cmn), which
upstream runs through the same HEAD code (``from_local(..., t3_model="t3_pt_br.safetensors")``; HEAD 5de7a54
changed nothing there).

The multilingual counterpart of test_e2e_parity. Upstream's ``ChatterboxMultilingualTTS`` is built from
modules as ``from_local`` builds it, every network at a tiny size: T3 with 14 layers of 16 heads (so that the
analyzer's (layer, head) pairs exist) and the 2454-id text vocabulary (``hp.is_multilingual``), and an
``S3Gen()`` whose five networks are replaced by tiny randomised ones (the builders of
test_flow/cfm/hift/s3tokenizer/campplus_parity). All of it is written in upstream's file layout (t3_mtl23ls_v2
/ v3.safetensors, s3gen.pt and ve.pt through ``torch.save``, the toy grapheme tokenizer and Cangjie map,
conds.pt) and ours is made from that folder by ``mlx_chatterbox.convert`` and ``TTS.load``, so that the real
conversion, the .pt reader included, sits in the loop. Upstream's T3, voice encoder, S3Gen and conds are read
back from those files, as ``from_local`` does; each case gets a fresh upstream T3 (the analyzer's hooks are
never removed and switch the model to eager attention). Upstream's tokenizer fetches Cangjie5_TC.json with
``hf_hub_download`` and its pkuseg downloads a model: here both read the toy files, as in
test_mtl_text_parity.

Both sides get the same draws: upstream's ``torch.multinomial`` is replaced by the inverse-CDF draw of the
injected uniforms (``oracle.injected_multinomial_tie_safe``; ties are counted and printed) and its S3Gen draws
(CFM noise, SineGen phases and noise) return ours (``test_s3gen_parity.injected``). Upstream's Perth
watermarker is an identity. Our public API takes a seed but no draws, so our side runs what ``TTS.generate``
runs, step by step: ``tts.text_ids(text, language)`` -> the variant's decode
(``generate_aligned_speech_tokens`` for v2, ``generate_speech_tokens`` for v3, as
``MultilingualSpeech.tokens`` picks) with the variant's params type -> ``tts.speech.finish`` ->
``tts.s3gen(tokens, voice, draws=)`` -> ``tts.speech.cut_samples`` (as ``TTS.generate``).

The v3 oracle is 0.1.7 with HEAD's differences (variants.md §5.7-5.9): no analyzer (0.1.7's ``T3.inference``
builds one when ``hp.is_multilingual``; that property reads False for the call, so the model also keeps its
SDPA attention, where 0.1.7's ``output_attentions=True`` only makes transformers warn and return no maps, the
same numbers as HEAD's False), ``repetition_penalty=1.2`` passed explicitly (HEAD's default; 0.1.7's is 2.0,
which our v2 takes by default) and ``wav[:, : max(1, n - 1) * 960]`` applied to upstream's waveform, n the
tokens S3Gen got.

Two edits to the random T3s keep the runs meaningful. Random weights draw ids in [6561, 8194) about one time
in five; upstream's multilingual ``drop_invalid_tokens`` passes them to S3Gen, which then fails, where ours
drops them as English does (a deviation on purpose, generation/multilingual.py). So every speech embedding
gets a constant 5 on hidden dimension MARK (it survives the near-identity random layers to the final norm) and
the speech head rows of 6561 and 6563..8193 read -20 x that dimension alone: their logits sit near -100 (the
others' spread is 0.6), no such id is ever drawn (asserted), and the comparison never reaches the deviation.
The v2 T3 also gives EOS a logit near +13 the same way: then EOS wins wherever it is allowed, so without the
analyzer T3 stops at once (checked on ours), and with it the analyzer's EOS suppression decides the length
(until the tapped heads' argmax reaches the last 3 text columns). The v3 T3 leaves EOS's row random: it runs
to the bound.

A pack is written in its own layout beside the others: its T3 under the pack's name (``t3_pt_br.safetensors``,
``t3_zh_cmn.safetensors``) and its own S3Gen as ``s3gen_v3.pt``, a state dict without the s3tokenizer's two
buffers (``tokenizer._mel_filters``, ``tokenizer.window``; absent at this tiny size anyway), which upstream's
S3Gen then loads with ``strict=False`` allowing those two only, as the packs' users load them (upstream's strict
``from_local`` refuses the file). Its voice encoder, conds and Cangjie map are ResembleAI/chatterbox's, as the
pack lacks them. Ours converts the same folder with ``variant=`` the pack and leaves the language out: the pack's
is the default.

Random weights rarely stop by themselves, so both sides are bounded: upstream ``generate`` hard-codes
``max_new_tokens=1000``, so that call is wrapped to pass ``MAX_NEW_TOKENS``; ours takes it in the params.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import mlx.core as mx
import numpy as np
import pytest
import torch
from chatterbox.models.s3gen import S3Gen as UpstreamS3Gen
from chatterbox.models.t3.modules.t3_config import T3Config as UpstreamT3Config
from chatterbox.models.tokenizers import tokenizer as upstream_tokenizer
from chatterbox.mtl_tts import ChatterboxMultilingualTTS, Conditionals
from safetensors.torch import load_file, save_file

from mlx_chatterbox import convert
from mlx_chatterbox.api import TTS
from mlx_chatterbox.generation.aligned import generate_aligned_speech_tokens
from mlx_chatterbox.generation.speech_tokens import generate_speech_tokens
from mlx_chatterbox.models.s3tokenizer import S3TokenizerConfig
from mlx_chatterbox.text import multilingual
from mlx_chatterbox.variants import CHECKPOINTS
from tests.conftest import TINY_MTL, TINY_MTL_V3
from tests.toy_mtl_tokenizer import write_toy_cangjie, write_toy_mtl_tokenizer, write_toy_pkuseg_home

from . import oracle
from .oracle import rel_err, rel_l2
from .test_campplus_parity import upstream_campplus
from .test_cfm_parity import upstream_cfm
from .test_e2e_parity import _NoWatermark
from .test_flow_parity import upstream_flow
from .test_hift_parity import upstream_hift
from .test_s3gen_parity import injected, random_draws, vocoder_errors
from .test_s3tokenizer_parity import upstream_s3tokenizer
from .test_voice_encoder_parity import upstream_voice_encoder

pytestmark = [pytest.mark.reference, pytest.mark.slow]

# conftest's tiny multilingual sizes; upstream's tokenizer takes heads of 64 channels only.
V2 = dataclasses.replace(TINY_MTL, s3tokenizer=S3TokenizerConfig(n_state=128, n_heads=2, n_layers=1))
V3 = dataclasses.replace(V2, variant=TINY_MTL_V3.variant)
PACKS = ("multilingual-v3-pt-br", "multilingual-v3-zh-cmn")
CONFIGS = {cfg.variant: cfg for cfg in (V2, V3, *(dataclasses.replace(V2, variant=v) for v in PACKS))}
T3_FILES = {variant: CHECKPOINTS[variant].t3 for variant in CONFIGS}
PACK_S3GEN = CHECKPOINTS[PACKS[0]].s3gen  # s3gen_v3.pt
NOT_IN_PACK_S3GEN = {"tokenizer._mel_filters", "tokenizer.window"}
EOS = V2.t3.stop_speech_token
SOS = V2.t3.start_speech_token
MARK = 0  # the hidden dimension of the T3 edits (module docstring)
MAX_NEW_TOKENS = {"multilingual": 48, **{variant: 24 for variant in CONFIGS if variant != "multilingual"}}
S3GEN_PROMPT_TOKENS = 20  # the built-in voice's S3Gen prompt
# (variant, language, text, knobs): punc_norm has work to do in each (lower-case start, a colon, double
# spaces, no final stop); ja and zh go through their transforms (pykakasi; pkuseg + Cangjie).
CASES = {
    "v2-fr": ("multilingual", "fr", "bonjour: comment allez-vous  aujourd'hui", {}),
    "v2-ja": (
        "multilingual",
        "ja",
        "私は学校へ行きます",
        dict(exaggeration=0.8, cfg_weight=1.0, temperature=1.3, repetition_penalty=1.5, min_p=0.0, top_p=0.9),
    ),
    "v3-zh": ("multilingual-v3", "zh", "我爱北京  天安门", {}),
    "v3-de": (
        "multilingual-v3",
        "de",
        "guten Tag: wie geht es Ihnen",
        dict(
            exaggeration=0.3, cfg_weight=0.8, temperature=0.9, repetition_penalty=1.6, min_p=0.02, top_p=0.95
        ),
    ),
    "pack-pt-br": ("multilingual-v3-pt-br", "pt", "olá: tudo bem  com você", dict(cfg_weight=0.7)),
    "pack-zh-cmn": ("multilingual-v3-zh-cmn", "zh", "天安门  我爱北京", {}),
}
# Bounds as test_e2e_parity (test_s3gen_parity's waveform bounds; its module docstring says why the waveform
# ones are loose): the mel S3Gen hands HiFT, our vocoder against upstream's on the same mel, the waveform.
# Measured here (2-core CPU): mel 8.0e-7 to 9.5e-7 (rel. max to 1.4e-6), vocoder 5.7e-5 to 1.8e-4, waveform
# 5.8e-5 to 2.8e-4.
MEL_TOL = 1e-5
WAV_TOL = 3e-3
CHAINED_WAV_TOL = 1e-2


def edited_t3(cfg, seed: int, eos: bool) -> torch.nn.Module:
    """An upstream T3 of ``cfg``'s sizes, random (``oracle.upstream_t3``), that never draws an id in
    [6561, 8194) but EOS; with ``eos``, EOS wins wherever it is not suppressed (module docstring)."""
    model = oracle.upstream_t3(cfg, seed=seed)
    head = model.speech_head.weight
    with torch.no_grad():
        model.speech_emb.weight[:, MARK] = 5.0
        invalid = [SOS, *range(EOS + 1, head.shape[0])]
        head[invalid] = 0.0
        head[invalid, MARK] = -20.0
        if eos:
            head[EOS] = 0.0
            head[EOS, MARK] = 2.8
    return model


def tiny_upstream_s3gen(cfg, seed: int) -> torch.nn.Module:
    """Upstream's ``S3Token2Wav`` with its five networks replaced by randomised ones of ``cfg``'s sizes.
    HiFT's log-magnitudes are lowered by 4 (e^-4): at this width they would put ~95% of the samples on
    upstream's +-0.99 clip, where any two waveforms agree."""
    model = UpstreamS3Gen()
    flow = upstream_flow(cfg.flow, seed)
    flow.decoder = upstream_cfm(cfg.cfm, seed + 1)
    model.flow = flow
    model.mel2wav = upstream_hift(cfg.hift, seed + 2)
    with torch.no_grad():
        model.mel2wav.conv_post.bias[: cfg.hift.istft_n_fft // 2 + 1] -= 4.0
    model.tokenizer = upstream_s3tokenizer(cfg.s3tokenizer, seed + 3)
    model.speaker_encoder = upstream_campplus(cfg.campplus, seed + 4)
    return model.eval()


@contextlib.contextmanager
def local_text_files(folder, pkuseg_home):
    """Upstream's Cangjie map from the folder instead of the Hub, and both sides' pkuseg from the toy home."""
    import spacy_pkuseg

    def local_cangjie(repo_id: str, filename: str, **kwargs) -> str:
        assert (repo_id, filename) == ("ResembleAI/chatterbox", "Cangjie5_TC.json")
        return str(folder / filename)

    multilingual._pkuseg_cut.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(upstream_tokenizer, "hf_hub_download", local_cangjie)
        patch.setattr(spacy_pkuseg.config, "pkuseg_home", str(pkuseg_home))
        yield
    multilingual._pkuseg_cut.cache_clear()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("pykakasi")
    pytest.importorskip("spacy_pkuseg")
    src = tmp_path_factory.mktemp("upstream")
    for (variant, name), seed in zip(T3_FILES.items(), (41, 42, 46, 47)):
        t3 = edited_t3(V2.t3, seed, eos=variant == "multilingual")
        save_file({k: v.contiguous() for k, v in t3.state_dict().items()}, str(src / name))
    # from_local loads s3gen.pt and ve.pt strictly: the whole state dicts. The packs' s3gen_v3.pt lacks two
    # buffers (module docstring).
    torch.save(tiny_upstream_s3gen(V2, seed=43).state_dict(), src / "s3gen.pt")
    pack_s3gen = tiny_upstream_s3gen(V2, seed=48).state_dict()
    torch.save({k: v for k, v in pack_s3gen.items() if k not in NOT_IN_PACK_S3GEN}, src / PACK_S3GEN)
    torch.save(upstream_voice_encoder(V2.voice_encoder, seed=44).state_dict(), src / "ve.pt")
    write_toy_mtl_tokenizer(src)
    write_toy_cangjie(src)
    oracle.random_conds(V2.t3, seed=45, gen_tokens=S3GEN_PROMPT_TOKENS).save(src / "conds.pt")
    pkuseg_home = write_toy_pkuseg_home(tmp_path_factory.mktemp("pkuseg"))

    with local_text_files(src, pkuseg_home):
        s3gen = tiny_upstream_s3gen(V2, seed=0)
        s3gen.load_state_dict(torch.load(src / "s3gen.pt", weights_only=True))
        pack_s3gen = tiny_upstream_s3gen(V2, seed=0)
        loaded = pack_s3gen.load_state_dict(torch.load(src / PACK_S3GEN, weights_only=True), strict=False)
        assert set(loaded.missing_keys) <= NOT_IN_PACK_S3GEN and not loaded.unexpected_keys
        ve = upstream_voice_encoder(V2.voice_encoder, seed=0)
        ve.load_state_dict(torch.load(src / "ve.pt", weights_only=True))
        tokenizer = upstream_tokenizer.MTLTokenizer(str(src / "grapheme_mtl_merged_expanded_v1.json"))
        assert tokenizer.cangjie_converter.word2cj and tokenizer.cangjie_converter.segmenter is not None
        # The T3 and the conds are set per case (run_upstream); the packs run with their own S3Gen.
        upstream = {}
        for variant in CONFIGS:
            decoder = pack_s3gen if variant in PACKS else s3gen
            upstream[variant] = ChatterboxMultilingualTTS(
                None, decoder.eval(), ve.eval(), tokenizer, device="cpu"
            )
            upstream[variant].watermarker = _NoWatermark()
        ours = {
            variant: TTS.load(
                convert(src, tmp_path_factory.mktemp("mlx") / "model", variant=variant, config=cfg)
            )
            for variant, cfg in CONFIGS.items()
        }
        yield upstream, ours, src


def fresh_upstream_t3(src, variant: str) -> torch.nn.Module:
    """T3 read back from its file into a new module (no analyzer hooks yet), as ``from_local`` does."""
    model = oracle.upstream_t3(V2.t3, seed=0)
    model.load_state_dict(load_file(src / T3_FILES[variant]))
    assert model.hp.is_multilingual
    return model.eval()


@contextlib.contextmanager
def bounded_and_injected(upstream, variant: str, uniforms: np.ndarray, draws_seed: int, seen: dict):
    """Upstream's generate with T3 bounded to the variant's MAX_NEW_TOKENS, every draw injected and, for v3,
    no analyzer. ``seen`` receives the uniforms our sampler needs for the same picks, T3's text ids and
    penalty, whether the analyzer was built, the speech tokens S3Gen gets, the S3Gen draws and the mel HiFT
    gets."""
    t3_inference, s3gen_inference = upstream.t3.inference, upstream.s3gen.inference
    hift_inference = upstream.s3gen.mel2wav.inference

    def bounded(**kwargs):
        assert kwargs["max_new_tokens"] == 1000  # what generate passes; replaced by our bound
        seen["text_ids"] = kwargs["text_tokens"][0].tolist()
        seen["repetition_penalty"] = kwargs["repetition_penalty"]
        try:
            return t3_inference(**{**kwargs, "max_new_tokens": MAX_NEW_TOKENS[variant]})
        finally:
            seen["analyzer"] = upstream.t3.patched_model.alignment_stream_analyzer is not None

    def vocode(speech_tokens, ref_dict, **kwargs):
        assert not kwargs  # generate's S3Gen call: upstream's 10 CFM steps
        seen["tokens"] = speech_tokens.tolist()
        total = 2 * (ref_dict["prompt_token"].shape[1] + speech_tokens.numel())
        seen["draws"] = random_draws(total, total - ref_dict["prompt_feat"].shape[1], draws_seed)
        with injected(seen["draws"]):
            return s3gen_inference(speech_tokens, ref_dict=ref_dict)

    def hift(speech_feat, **kwargs):
        seen["mel"] = speech_feat.numpy().transpose(0, 2, 1)
        return hift_inference(speech_feat=speech_feat, **kwargs)

    upstream.t3.inference, upstream.s3gen.inference, upstream.s3gen.mel2wav.inference = bounded, vocode, hift
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                oracle.injected_multinomial_tie_safe(uniforms, seen.setdefault("ours_uniforms", []))
            )
            if variant != "multilingual":  # HEAD (v3, the packs): T3.inference builds no alignment analyzer
                patch = stack.enter_context(pytest.MonkeyPatch.context())
                patch.setattr(UpstreamT3Config, "is_multilingual", property(lambda hp: False))
            yield
    finally:
        del upstream.t3.inference, upstream.s3gen.inference, upstream.s3gen.mel2wav.inference


def run_upstream(upstream, src, variant, language, text, knobs, uniforms, draws_seed):
    """Upstream ``generate`` (v3: HEAD's T3 call, module docstring) on ``text``: what T3 and S3Gen were given
    (``bounded_and_injected``) and the (1, samples) waveform, before v3's trim."""
    upstream.t3 = fresh_upstream_t3(src, variant)
    upstream.conds = Conditionals.load(src / "conds.pt")  # T3Cond caches the prompt embedding of its T3
    if variant != "multilingual":
        knobs = {"repetition_penalty": 1.2, **knobs}  # HEAD's default
    seen = {}
    with bounded_and_injected(upstream, variant, uniforms, draws_seed, seen):
        wav = upstream.generate(text, language, **knobs).numpy()
    return seen, wav


def run_ours(tts: TTS, language, text, knobs, uniforms: np.ndarray, draws):
    """``TTS.generate`` on ``text`` step by step, with the draws injected (module docstring): text ids,
    params, raw T3 output, speech tokens, the mel S3Gen hands HiFT, and the (1, samples) waveform, before v3's
    cut."""
    variant = tts.speech.variant
    params = tts.speech.params_type(max_new_tokens=MAX_NEW_TOKENS[variant], **knobs)
    ids = tts.text_ids(text, language)
    decode = generate_aligned_speech_tokens if tts.speech.analyzer else generate_speech_tokens
    voice = tts.builtin_voice
    raw = list(decode(tts.t3, voice, ids, params, uniforms=mx.array(uniforms)))
    tokens = tts.speech.finish(raw)
    hift, mels = tts.s3gen.hift, []

    def capture(mel, **kwargs):
        mels.append(mel)
        return hift(mel, **kwargs)

    tts.s3gen.hift = capture
    try:
        wav = tts.s3gen(mx.array([tokens], dtype=mx.int32), voice, draws=draws)
    finally:
        tts.s3gen.hift = hift
    return ids, params, raw, tokens, np.array(mels[0]), np.array(wav, dtype=np.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_text_to_waveform_matches_upstream_generate(models, case):
    upstreams, ours, src = models
    variant, language, text, knobs = CASES[case]
    tts, upstream = ours[variant], upstreams[variant]
    bound = MAX_NEW_TOKENS[variant]
    seed = list(CASES).index(case)
    uniforms = np.random.default_rng(seed).random(bound).astype(np.float32)

    start = time.perf_counter()
    seen, ref_full = run_upstream(upstream, src, variant, language, text, knobs, uniforms, seed)
    upstream_s = time.perf_counter() - start
    start = time.perf_counter()
    # Upstream may stop early (EOS); the uniforms it did not use are not used by ours either.
    ours_uniforms = np.array(
        seen["ours_uniforms"] + uniforms[len(seen["ours_uniforms"]) :].tolist(), np.float32
    )
    ties = int((ours_uniforms != uniforms).sum())
    # A pack speaks its language by default: ours is not told it.
    ours_language = None if variant in PACKS else language
    ids, params, raw, tokens, mel, full = run_ours(
        tts, ours_language, text, knobs, ours_uniforms, seen["draws"]
    )
    ours_s = time.perf_counter() - start

    t3 = tts.t3.config
    assert seen["analyzer"] == tts.speech.analyzer == (variant == "multilingual")
    assert params.repetition_penalty == seen["repetition_penalty"]
    assert [t3.start_text_token, *ids, t3.stop_text_token] == seen["text_ids"], "text ids differ"
    assert tokens == seen["tokens"], f"speech tokens differ (raw T3 output {raw})"
    assert all(t < SOS for t in raw[:-1]) and (raw[-1] < SOS or raw[-1] == EOS)  # module docstring
    assert len(tokens) >= 10, f"only {len(tokens)} speech tokens: pick other uniforms to test something"
    if variant == "multilingual":
        # The analyzer decides the length: it stops at EOS before the bound, where T3 alone stops at once.
        assert raw[-1] == EOS and len(raw) < bound
        plain = list(
            generate_speech_tokens(tts.t3, tts.builtin_voice, ids, params, uniforms=mx.array(ours_uniforms))
        )
        assert plain[0] == EOS
    else:
        assert len(raw) == bound and EOS not in raw
    # v3: HEAD's trim of upstream's waveform, and ours as TTS.generate cuts each piece.
    n = len(tokens)
    ref_wav = ref_full[:, : max(1, n - 1) * 960] if variant != "multilingual" else ref_full
    wav = full[:, : full.shape[1] - tts.speech.cut_samples(n)]
    assert mel.shape == seen["mel"].shape and full.shape == ref_full.shape == (1, 960 * n)
    assert wav.shape == ref_wav.shape
    clipped = float(np.mean(np.abs(ref_full) >= 0.98))
    assert clipped < 0.01, f"{clipped:.0%} of upstream's samples at its clip: the comparison means little"
    errors = {
        "mel": rel_l2(mel, seen["mel"]),
        "mel max": rel_err(mel, seen["mel"]),
        "waveform": rel_l2(wav, ref_wav),
    }
    # Our vocoder against upstream's on the same mel: whole waveforms, before v3's trim.
    errors.update(vocoder_errors(tts.s3gen, upstream.s3gen, full, mel, ref_full, seen["mel"], seen["draws"]))
    numbers = ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
    stop = "EOS" if raw[-1] == EOS else f"the bound of {bound}"
    print(
        f"{case}: {len(ids) + 2} text ids, {len(raw)} raw -> {len(tokens)} speech tokens, exact (stopped at "
        f"{stop}, {ties} ties), {clipped:.1%} clipped; rel. L2: {numbers} (upstream {upstream_s:.1f} s, ours "
        f"{ours_s:.1f} s)"
    )
    assert errors["mel"] < MEL_TOL, numbers
    assert errors["vocoder"] < WAV_TOL and errors["vocoder on our mel"] < WAV_TOL, numbers
    assert errors["waveform"] < CHAINED_WAV_TOL, numbers
