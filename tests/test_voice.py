"""Voice files: exact round trip, validation, atomic writes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatterbox.generation.voice import Voice
from tests.conftest import random_voice


def test_round_trip_is_exact(tmp_path):
    voice = random_voice(seed=2, prompt_len=77, gen_tokens=33)
    path = voice.save(tmp_path / "v.safetensors")
    loaded = Voice.load(path)
    for field in ("speaker_emb", "t3_prompt_tokens", "s3gen_prompt_tokens", "s3gen_prompt_mel", "xvector"):
        a, b = getattr(voice, field), getattr(loaded, field)
        assert a.dtype == b.dtype and np.array_equal(np.array(a), np.array(b))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.safetensors"]


def test_odd_prompt_mel_length_is_accepted():
    v = random_voice(gen_tokens=10)
    Voice(v.speaker_emb, v.t3_prompt_tokens, v.s3gen_prompt_tokens, mx.zeros((1, 21, 80)), v.xvector)


def test_a_voice_without_s3gen_prompt_round_trips(tmp_path):
    v = random_voice()
    v = Voice(v.speaker_emb, v.t3_prompt_tokens, mx.zeros((1, 0), mx.int32), mx.zeros((1, 0, 80)), v.xvector)
    loaded = Voice.load(v.save(tmp_path / "v.safetensors"))
    assert loaded.s3gen_prompt_tokens.shape == (1, 0) and loaded.s3gen_prompt_mel.shape == (1, 0, 80)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("speaker_emb", mx.zeros((256,)), "speaker_emb must be a float"),
        ("t3_prompt_tokens", mx.zeros((1, 5)), "t3_prompt_tokens must be an int32"),
        ("t3_prompt_tokens", mx.zeros((1, 0), mx.int32), r"t3_prompt_tokens must be an int32 \(1, N >= 1\)"),
        ("s3gen_prompt_tokens", mx.zeros((1, 3)), "s3gen_prompt_tokens must be an int32"),
        ("s3gen_prompt_mel", mx.zeros((1, 79, 80)), "s3gen_prompt_mel must be"),
        ("xvector", mx.zeros((1, 192), mx.int32), "xvector must be a float"),
    ],
)
def test_invalid_fields(field, value, message):
    v = random_voice()
    fields = dict(v.__dict__, **{field: value})
    with pytest.raises(ValueError, match=message):
        Voice(**fields)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Voice.load(tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors voice file"):
        Voice.load(tmp_path / "junk.safetensors")
    mx.save_safetensors(str(tmp_path / "other.safetensors"), {"x": mx.zeros(2)})
    with pytest.raises(ValueError, match="not an mlx-chatterbox voice file"):
        Voice.load(tmp_path / "other.safetensors")
