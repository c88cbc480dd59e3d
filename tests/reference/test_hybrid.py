"""Hybrid mode (``hybrid.py``, ``--s3gen torch``): our tokens vocoded by upstream's own PyTorch S3Gen, loaded from
the checkpoint the folder was converted from."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mlx_chatterbox import TTS, convert
from mlx_chatterbox.variants import ENGLISH
from tests.conftest import TINY, random_voice, random_weights, upstream_t3_weights
from tests.toy_tokenizer import write_toy_tokenizer

from . import oracle

pytestmark = [pytest.mark.reference, pytest.mark.slow]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    import mlx.core as mx

    from mlx_chatterbox.models.voice_encoder import VoiceEncoder

    src = tmp_path_factory.mktemp("upstream")
    # Full-size S3Gen (upstream's S3Token2Wav has fixed sizes), tiny T3 and voice encoder.
    oracle.write_s3gen_checkpoint(oracle.upstream_s3gen(seed=11), src)
    mx.save_safetensors(
        str(src / "t3_cfg.safetensors"), {k: mx.array(v) for k, v in upstream_t3_weights(TINY).items()}
    )
    ve = random_weights(VoiceEncoder.checkpoint_table(ENGLISH.voice_encoder), np.random.default_rng(0))
    mx.save_safetensors(str(src / "ve.safetensors"), {k: mx.array(v) for k, v in ve.items()})
    write_toy_tokenizer(src / "tokenizer.json")
    config = dataclasses.replace(ENGLISH, t3=TINY)
    return src, convert(src, tmp_path_factory.mktemp("mlx") / "model", config=config)


def test_torch_s3gen_is_upstreams_decoder_on_our_tokens(folders):
    from chatterbox.models.s3gen import S3Gen

    src, dst = folders
    tts = TTS.load(dst, s3gen="torch")
    voice = random_voice(seed=4, gen_tokens=12)
    tokens = np.random.default_rng(1).integers(0, 6561, 20)
    wav = tts.vocode(tokens, voice, cfm_steps=2, seed=3, watermark=False)
    assert wav.dtype == np.float32 and wav.shape == (960 * 20,)

    upstream = S3Gen()
    upstream.load_state_dict(load_file(str(src / "s3gen.safetensors")), strict=False)
    upstream.eval()
    ref = dict(
        prompt_token=torch.from_numpy(np.array(voice.s3gen_prompt_tokens).astype(np.int64)),
        prompt_token_len=torch.tensor([12]),
        prompt_feat=torch.from_numpy(np.array(voice.s3gen_prompt_mel)),
        prompt_feat_len=None,
        embedding=torch.from_numpy(np.array(voice.xvector)),
    )
    torch.manual_seed(3)
    want, _ = upstream.inference(
        speech_tokens=torch.from_numpy(tokens)[None], ref_dict=ref, n_cfm_timesteps=2
    )
    np.testing.assert_array_equal(wav, want[0].numpy())
    with pytest.raises(ValueError, match="must lie in"):
        tts.vocode([1, 7000], voice)


def test_missing_torch_says_how_to_install(folders, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install 'mlx-chatterbox\[hybrid\]'.*torch not installed"):
        TTS.load(folders[1], s3gen="torch")
