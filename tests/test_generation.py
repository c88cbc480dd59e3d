"""The T3 decode loop on a tiny random model: stop rules, lengths, seeds, CFG on/off (no torch)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatterbox.generation.speech_tokens import drop_invalid_tokens, generate_speech_tokens
from mlx_chatterbox.sampling import SamplingParams

TEXT = [5, 17, 42, 2, 99, 7]
EOS = 6562


def run(model, voice, **kw):
    key = kw.pop("key", None)
    uniforms = kw.pop("uniforms", None)
    stop = kw.pop("stop_on_eos", True)
    return list(
        generate_speech_tokens(
            model, voice, TEXT, SamplingParams(**kw), key=key, uniforms=uniforms, stop_on_eos=stop
        )
    )


def test_max_new_tokens_is_exact_without_eos(tiny_t3, voice):
    assert len(run(tiny_t3, voice, max_new_tokens=17, stop_on_eos=False, key=mx.random.key(1))) == 17
    assert len(run(tiny_t3, voice, max_new_tokens=1, temperature=0)) == 1


def test_stops_at_eos_and_yields_it(tiny_t3, voice):
    model = tiny_t3
    w = np.array(model.speech_head.weight)
    # Give EOS a head row that dominates the first greedy pick, so it wins the arg-max.
    baseline = run(model, voice, temperature=0, max_new_tokens=5)
    assert EOS not in baseline
    w[EOS] = 50 * w[baseline[0]]
    model.speech_head.weight = mx.array(w)
    out = run(model, voice, temperature=0, max_new_tokens=50)
    assert out == [EOS]
    assert drop_invalid_tokens(out, 6561, EOS) == []
    out = run(model, voice, temperature=0, max_new_tokens=6, stop_on_eos=False)
    assert len(out) == 6 and out[0] == EOS


def test_new_weights_are_not_hidden_by_a_compiled_step(tiny_t3, voice):
    """A compiled decode step holds the weights it was traced with: changing the model's weights must drop it."""
    from mlx.utils import tree_flatten

    from mlx_chatterbox.models.t3 import T3

    model = tiny_t3
    baseline = run(model, voice, temperature=0, max_new_tokens=8, stop_on_eos=False)
    assert model.compiled_steps
    # Every layer's MLP output negated: the same shapes, other tokens.
    model.update(
        {
            "tfmr": {
                "layers": [
                    {"mlp": {"down_proj": {"weight": -l.mlp.down_proj.weight}}} for l in model.tfmr.layers
                ]
            }
        }
    )
    assert not model.compiled_steps
    fresh = T3(model.config)
    fresh.load_weights(tree_flatten(model.parameters()), strict=True)
    changed = run(model, voice, temperature=0, max_new_tokens=8, stop_on_eos=False)
    assert changed == run(fresh, voice, temperature=0, max_new_tokens=8, stop_on_eos=False)
    assert changed[1:] != baseline[1:]
    model.set_dtype(mx.float32)  # goes through update too
    assert not model.compiled_steps


def test_same_seed_same_tokens_different_seed_different_tokens(tiny_t3, voice):
    a = run(
        tiny_t3, voice, max_new_tokens=20, stop_on_eos=False, key=mx.random.key(3), temperature=1.5, min_p=0.0
    )
    b = run(
        tiny_t3, voice, max_new_tokens=20, stop_on_eos=False, key=mx.random.key(3), temperature=1.5, min_p=0.0
    )
    c = run(
        tiny_t3, voice, max_new_tokens=20, stop_on_eos=False, key=mx.random.key(4), temperature=1.5, min_p=0.0
    )
    assert a == b and a != c


def test_greedy_is_deterministic_and_cfg_zero_runs_batch_one(tiny_t3, voice):
    a = run(tiny_t3, voice, temperature=0, max_new_tokens=10)
    assert a == run(tiny_t3, voice, temperature=0, max_new_tokens=10)
    no_cfg = run(tiny_t3, voice, temperature=0, cfg_weight=0.0, max_new_tokens=10)
    assert len(no_cfg) == 10  # upstream crashes here; we decode the conditional row alone
    assert no_cfg != run(tiny_t3, voice, temperature=0, cfg_weight=3.0, max_new_tokens=10)


def test_uniform_draws_replace_the_prng(tiny_t3, voice):
    u = mx.array(np.random.default_rng(0).random(12).astype(np.float32))
    a = run(tiny_t3, voice, max_new_tokens=12, stop_on_eos=False, uniforms=u)
    assert a == run(tiny_t3, voice, max_new_tokens=12, stop_on_eos=False, uniforms=u)
    with pytest.raises(ValueError, match="one per token"):
        run(tiny_t3, voice, max_new_tokens=13, uniforms=u)
    with pytest.raises(ValueError, match="give no key, and a temperature > 0"):
        run(tiny_t3, voice, max_new_tokens=12, uniforms=u, key=mx.random.key(0))
    with pytest.raises(ValueError, match="give no key, and a temperature > 0"):
        run(tiny_t3, voice, max_new_tokens=12, uniforms=u, temperature=0)


def test_requests_the_model_cannot_take_fail_before_work(tiny_t3, voice):
    long_text = [5] * 2049
    with pytest.raises(ValueError, match="2049 tokens long; the model takes at most 2048"):
        list(generate_speech_tokens(tiny_t3, voice, long_text))
    with pytest.raises(ValueError, match="outside the model's text vocabulary"):
        list(generate_speech_tokens(tiny_t3, voice, [704]))
    with pytest.raises(ValueError, match="max_new_tokens=5000"):
        list(generate_speech_tokens(tiny_t3, voice, TEXT, SamplingParams(max_new_tokens=5000)))


@pytest.mark.parametrize(
    "raw, want",
    [
        ([1, 2, 3], [1, 2, 3]),
        ([1, 2, EOS], [1, 2]),
        ([1, 6561, 2, 3, EOS], [2, 3]),
        ([1, 7000, 2, 8193, EOS, 5], [1, 2]),
        ([6561, 1, 6561, 2, EOS], [1, 2]),  # upstream crashes on a second start id; we keep after the first
        ([EOS], []),
    ],
)
def test_drop_invalid_tokens(raw, want):
    assert drop_invalid_tokens(raw, 6561, EOS) == want


def test_api_rejects_unknown_knobs(tmp_path):
    from mlx_chatterbox import TTS
    from mlx_chatterbox.convert import convert
    from tests.conftest import TINY_MODEL, random_voice, write_upstream_checkpoint

    tts = TTS.load(convert(write_upstream_checkpoint(tmp_path / "up"), tmp_path / "mlx", config=TINY_MODEL))
    with pytest.raises(
        TypeError, match="unknown knob 'temprature' for the english model; its knobs are temperature, top_p"
    ):
        tts.speech_tokens("Hello.", random_voice(), temprature=0.5)
    assert len(tts.speech_tokens("Hello.", random_voice(), temperature=0, max_new_tokens=3)) <= 3
