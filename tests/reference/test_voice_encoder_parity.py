"""Voice encoder parity with upstream chatterbox-tts 0.1.7 (``models/voice_encoder``) on random weights, fp32.

The upstream state dict goes through *our* ``sanitize`` with ``VoiceEncoder.checkpoint_table`` and loads strictly
into our model. Upstream runs the path ``tts.py`` takes, ``embeds_from_wavs([wav], sample_rate=16000)``, which
reaches ``inference`` with rate 1.3, min_coverage 0.8 and batch_size 32 (overlap is unused once rate is set);
from the mel on that is ``embeds_from_mels([mel], rate=1.3)``. Hooks on the upstream module capture the partial
windows it builds (compared exactly), the LSTM's final hidden state and the per-window embeddings.
Error measure: relative L2, ||ours - ref|| / ||ref||.
"""

from __future__ import annotations

import subprocess

import librosa
import mlx.core as mx
import numpy as np
import pytest
import soundfile
import torch
from chatterbox.models.voice_encoder import VoiceEncConfig
from chatterbox.models.voice_encoder import VoiceEncoder as UpstreamVoiceEncoder
from chatterbox.models.voice_encoder.melspec import melspectrogram
from chatterbox.models.voice_encoder.voice_encoder import get_frame_step, get_num_wins

from mlx_chatterbox.models.voice_encoder import VoiceEncoder, VoiceEncoderConfig, num_partials

from .oracle import ours_from, randomize_voice_encoder_, rel_l2

pytestmark = pytest.mark.reference

TOL = 1e-5
FULL = VoiceEncoderConfig()
TINY = VoiceEncoderConfig(n_mels=8, hidden_size=32, embedding_size=16)  # upstream hard-wires 3 layers
# 1, 100: one zero-padded window; 160: exactly one; 204: a 127-frame second window, dropped (44 frames
# ignored); 205: 128/160 = 0.8 coverage, kept with 32 padded frames; 237: exactly two; 282: three, padded;
# 1000: twelve; 2700: 34 windows, so upstream's batch_size=32 splits them into two chunks.
LENGTHS = (1, 100, 160, 204, 205, 237, 282, 1000, 2700)


def upstream_voice_encoder(cfg: VoiceEncoderConfig, seed: int) -> UpstreamVoiceEncoder:
    """An upstream ``VoiceEncoder`` of ``cfg``'s sizes, randomised, in eval mode. ``rate`` and ``min_coverage`` are
    call arguments upstream: pass them to ``embeds_from_mels`` (see ``reference``)."""
    if cfg.num_layers != 3:
        raise ValueError(f"upstream VoiceEncoder hard-wires a 3-layer LSTM, got num_layers={cfg.num_layers}")
    hp = VoiceEncConfig()  # instance attributes shadow the class defaults for this model only
    hp.num_mels, hp.ve_hidden_size, hp.speaker_embed_size = cfg.n_mels, cfg.hidden_size, cfg.embedding_size
    hp.ve_partial_frames, hp.sample_rate, hp.ve_final_relu = (
        cfg.partial_frames,
        cfg.sample_rate,
        cfg.final_relu,
    )
    torch.manual_seed(seed)
    model = UpstreamVoiceEncoder(hp)
    randomize_voice_encoder_(model, seed)
    return model.eval()


@torch.inference_mode()
def reference(upstream: UpstreamVoiceEncoder, run, *args, **kwargs) -> dict[str, np.ndarray]:
    """Run ``run(*args, **kwargs)`` (an upstream entry point) and capture, over all chunks, the windows fed to
    ``forward`` (P, F, M), the last LSTM layer's final hidden state (P, H) and the window embeddings (P, E).
    """
    seen: dict[str, list[torch.Tensor]] = {"partials": [], "hidden": [], "embeds": []}

    def on_forward(module, args, out):
        seen["partials"].append(args[0].clone())
        seen["embeds"].append(out.clone())

    def on_lstm(module, args, out):
        seen["hidden"].append(out[1][0][-1].clone())

    hooks = [upstream.register_forward_hook(on_forward), upstream.lstm.register_forward_hook(on_lstm)]
    try:
        utt = run(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    out = {k: torch.cat(v).numpy() for k, v in seen.items()}
    out["utterance"] = np.asarray(utt)[0]
    return out


def from_mel(
    upstream: UpstreamVoiceEncoder, mel: np.ndarray, cfg: VoiceEncoderConfig
) -> dict[str, np.ndarray]:
    return reference(upstream, upstream.embeds_from_mels, [mel], rate=cfg.rate, min_coverage=cfg.min_coverage)


def random_mel(frames: int, n_mels: int, seed: int) -> np.ndarray:
    """Non-negative, heavy-tailed values like a linear power mel."""
    return np.random.default_rng(seed).gamma(0.5, 1.0, (frames, n_mels)).astype(np.float32)


def compare(ours: VoiceEncoder, ref: dict[str, np.ndarray], mel: np.ndarray, label: str) -> None:
    partials = ours.partials(mx.array(mel))
    np.testing.assert_array_equal(np.array(partials), ref["partials"], err_msg=f"{label}: partial windows")
    errs = {
        "hidden": rel_l2(ours.hidden(partials), ref["hidden"]),
        "window embeddings": rel_l2(ours.embed_partials(partials), ref["embeds"]),
        "utterance": rel_l2(ours(mx.array(mel)), ref["utterance"]),
    }
    print(f"{label}: {len(ref['partials'])} windows, " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    for name, err in errs.items():
        assert err < TOL, f"{label}: {name} rel L2 {err:.2e} >= {TOL}"


@pytest.fixture(scope="module")
def full():
    upstream = upstream_voice_encoder(FULL, seed=0)
    return upstream, ours_from(upstream, VoiceEncoder, FULL)


@pytest.mark.parametrize("rate, min_coverage", [(1.3, 0.8), (1.0, 0.8), (2.0, 0.5), (1.3, 1.0), (0.9, 0.01)])
def test_window_counts_match_upstream(rate, min_coverage):
    cfg = VoiceEncoderConfig(rate=rate, min_coverage=min_coverage)
    hp = VoiceEncConfig()
    step = get_frame_step(0.5, rate, hp)
    assert cfg.frame_step == step
    for frames in range(1, 1500):
        assert num_partials(frames, cfg) == get_num_wins(frames, step, min_coverage, hp), frames


@pytest.mark.parametrize("frames", LENGTHS)
def test_full_size_from_mel(full, frames):
    upstream, ours = full
    mel = random_mel(frames, FULL.n_mels, seed=frames)
    compare(ours, from_mel(upstream, mel, FULL), mel, f"full, {frames} frames")


@pytest.mark.parametrize("frames", (1, 205, 700))
def test_tiny_from_mel(frames):
    upstream = upstream_voice_encoder(TINY, seed=1)
    mel = random_mel(frames, TINY.n_mels, seed=frames)
    compare(
        ours_from(upstream, VoiceEncoder, TINY), from_mel(upstream, mel, TINY), mel, f"tiny, {frames} frames"
    )


def speech_16k(tmp_path) -> np.ndarray:
    """An espeak-ng sentence resampled to 16 kHz by sox, with 0.7 s of low noise before and 0.4 s of silence
    after, so the trim has edges to cut; the length is not a multiple of the 160-sample hop."""
    raw, wav = tmp_path / "speech.wav", tmp_path / "speech16k.wav"
    subprocess.run(
        [
            "espeak-ng",
            "-w",
            str(raw),
            "Hello there, this is my voice. It should be long enough for three windows.",
        ],
        check=True,
    )
    subprocess.run(["sox", str(raw), "-r", "16000", "-b", "32", "-e", "floating-point", str(wav)], check=True)
    x, sr = soundfile.read(wav, dtype="float32")
    assert sr == 16000
    noise = 1e-4 * np.random.default_rng(0).standard_normal(11_203).astype(np.float32)
    return np.concatenate([noise, x, np.zeros(6_400, np.float32)])


def test_tts_path_from_speech(full, tmp_path):
    """Upstream ``embeds_from_wavs`` as ``tts.py`` calls it, against ours on upstream's own trimmed-wav mel."""
    upstream, ours = full
    wav = speech_16k(tmp_path)
    ref = reference(upstream, upstream.embeds_from_wavs, [wav], sample_rate=16000)
    trimmed = librosa.effects.trim(wav, top_db=20)[0]
    mel = melspectrogram(trimmed, upstream.hp).T  # (T, 40) linear power
    assert len(trimmed) < len(wav) and mel.shape == (1 + len(trimmed) // 160, 40)
    compare(ours, ref, mel, f"speech, {mel.shape[0]} frames")
