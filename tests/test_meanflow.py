"""The meanflow decoder (Turbo/Nano, variants.md §3) on tiny random configs, no torch: the config's defaults,
the mixer key, the r input, the linear schedule, the solver's steps, and S3Gen's dispatch, default steps,
injected draws and batching."""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_chatterbox.convert import ConversionError, convert_s3gen, sanitize
from mlx_chatterbox.generation.vocode import Draws, S3Gen
from mlx_chatterbox.models.cfm import CFMConfig, Estimator, linear_schedule, solve, solve_meanflow
from mlx_chatterbox.models.flow import Flow
from mlx_chatterbox.models.hift import HiFT
from mlx_chatterbox.variants import config_from_dict
from tests.conftest import TINY_MODEL, random_voice, upstream_s3gen_weights

SIZES = dict(
    in_channels=32, out_channels=8, channels=24, n_blocks=1, num_mid_blocks=2, num_heads=2, head_dim=8
)
TINY = CFMConfig(**SIZES, meanflow=True)
TINY_ENGLISH = CFMConfig(**SIZES)
MEL = TINY.out_channels
MIXER = "time_embed_mixer.weight"
# conftest's tiny S3Gen with a meanflow decoder of the same sizes
MEANFLOW_CFM = dataclasses.replace(TINY_MODEL.cfm, n_timesteps=None, cfg_rate=None, meanflow=True)
TINY_MEANFLOW = dataclasses.replace(TINY_MODEL, cfm=MEANFLOW_CFM)


def upstream_weights(cfg: CFMConfig, seed: int = 0) -> dict[str, mx.array]:
    """Random tensors under upstream's keys and shapes: norm weights 1 + 0.1·N, biases 0.1·N, weights
    N / sqrt(fan_in) (the mixer too: far from upstream's [I | 0])."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, (_, shape, *_) in Estimator.checkpoint_table(cfg).items():
        w = rng.standard_normal(shape)
        if len(shape) == 1:
            w = 1 + 0.1 * w if key.endswith(".weight") else 0.1 * w
        else:
            w = w / math.sqrt(np.prod(shape[1:]))
        out[key] = mx.array(w.astype(np.float32))
    return out


def build(cfg: CFMConfig, weights: dict[str, mx.array]) -> Estimator:
    model = Estimator(cfg)
    model.load_weights(list(sanitize(weights, Estimator.checkpoint_table(cfg), "test").items()), strict=True)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def estimator() -> Estimator:
    return build(TINY, upstream_weights(TINY))


def batch(lengths: list[int], seed: int = 0):
    rng = np.random.default_rng(seed)
    b, n = len(lengths), max(lengths)
    f = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    mask = mx.array(np.arange(n)[None] < np.array(lengths)[:, None])
    return f(b, n, MEL), mask, f(b, n, MEL), f(b, MEL), f(b, n, MEL)  # x, mask, mu, spks, cond


def close(a: mx.array, b: mx.array, tol: float = 1e-5) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max()) <= tol * max(float(np.abs(b).max()), 1e-12)


def test_config_defaults_follow_the_kind():
    """Upstream's defaults: 10 guided steps for English, 2 unguided for meanflow (S3Token2Wav.flow_inference)."""
    assert (CFMConfig().n_timesteps, CFMConfig().cfg_rate, CFMConfig().meanflow) == (10, 0.7, False)
    assert (CFMConfig(meanflow=True).n_timesteps, CFMConfig(meanflow=True).cfg_rate) == (2, 0.0)
    assert CFMConfig(meanflow=True, n_timesteps=1).n_timesteps == 1
    assert CFMConfig(meanflow=True, cfg_rate=0.0).cfg_rate == 0.0
    with pytest.raises(ValueError, match="without guidance"):
        CFMConfig(meanflow=True, cfg_rate=0.7)
    with pytest.raises(ValueError, match="without guidance"):  # replacing an English config carries its 0.7
        dataclasses.replace(CFMConfig(), meanflow=True)
    # config.json records the numbers in use, and old English files (without the field) stay English
    for cfg in (TINY, TINY_ENGLISH, CFMConfig(meanflow=True)):
        assert config_from_dict(CFMConfig, dataclasses.asdict(cfg)) == cfg
    old = {k: v for k, v in dataclasses.asdict(CFMConfig()).items() if k != "meanflow"}
    assert config_from_dict(CFMConfig, old) == CFMConfig()


def test_the_mixer_is_in_the_table_only_for_meanflow():
    for sizes in (SIZES, {}):
        english, meanflow = CFMConfig(**sizes), CFMConfig(**sizes, meanflow=True)
        a, b = Estimator.checkpoint_table(english), Estimator.checkpoint_table(meanflow)
        temb = english.time_embed_dim
        assert set(b) - set(a) == {MIXER} and set(a) < set(b)
        assert b[MIXER] == (MIXER, (temb, 2 * temb))  # Linear(2·1024 -> 1024), no bias
        for cfg, table in ((english, a), (meanflow, b)):
            ours = dict(tree_flatten(Estimator(cfg).parameters()))
            assert {rule[0] for rule in table.values()} == set(ours)
    assert len(Estimator.checkpoint_table(CFMConfig(meanflow=True))) == 911  # 910 + the mixer


def test_r_is_required_by_meanflow_and_refused_otherwise(estimator):
    x, mask, mu, spks, cond = batch([6])
    t = mx.zeros((1,))
    with pytest.raises(ValueError, match="needs r"):
        estimator(x, mask, mu, t, spks, cond)
    english = build(TINY_ENGLISH, upstream_weights(TINY_ENGLISH))
    with pytest.raises(ValueError, match="meanflow estimators only"):
        english(x, mask, mu, t, spks, cond, r=t)
    with pytest.raises(ValueError, match="solve_meanflow"):
        solve(estimator, mu, mask, spks, cond, x, 2)
    with pytest.raises(ValueError, match="needs a meanflow estimator"):
        solve_meanflow(english, mu, mask, spks, cond, x, 2)


def test_upstreams_initial_mixer_ignores_r_and_a_random_one_does_not(estimator):
    """With upstream's [I | 0] init (utils/intmeanflow.py) the meanflow estimator is the English one with the same
    weights, whatever r; the randomised mixer makes r matter (which is why the parity tests randomise it)."""
    weights = upstream_weights(TINY)
    temb = TINY.time_embed_dim
    eye = mx.concatenate([mx.eye(temb), mx.zeros((temb, temb))], axis=1)
    identity = build(TINY, {**weights, MIXER: eye})
    english = build(TINY_ENGLISH, {k: v for k, v in weights.items() if k != MIXER})
    x, mask, mu, spks, cond = batch([7, 5], seed=1)
    t = mx.array([0.0, 0.5])
    ref = english(x, mask, mu, t, spks, cond)
    for r in ([0.5, 1.0], [0.9, 0.6]):
        assert close(identity(x, mask, mu, t, spks, cond, r=mx.array(r)), ref, 1e-6)
    a = estimator(x, mask, mu, t, spks, cond, r=mx.array([0.5, 1.0]))
    b = estimator(x, mask, mu, t, spks, cond, r=mx.array([0.9, 0.6]))
    assert not close(a, b, 1e-2)


def test_padded_rows_match_their_unpadded_run(estimator):
    x, mask, mu, spks, cond = batch([9, 4], seed=2)
    t, r = mx.array([0.2, 0.5]), mx.array([0.7, 1.0])
    padded = estimator(x, mask, mu, t, spks, cond, r=r)
    assert np.all(np.asarray(padded)[1, 4:] == 0)
    alone = estimator(x[1:, :4], None, mu[1:, :4], t[1:], spks[1:], cond[1:, :4], r=r[1:])
    assert close(padded[1, :4], alone[0])


def test_linear_schedule():
    assert np.asarray(linear_schedule(1)).tolist() == [0.0, 1.0]
    assert np.asarray(linear_schedule(2)).tolist() == [0.0, 0.5, 1.0]  # Turbo's t_span
    for n in (3, 7, 10, 33):
        t = np.asarray(linear_schedule(n))
        assert t.dtype == np.float32 and t.shape == (n + 1,) and t[0] == 0 and t[-1] == 1
        assert np.all(np.diff(t) > 0) and np.abs(t - np.arange(n + 1) / n).max() < 1.2e-7


def test_one_step_is_one_unguided_step_from_0_to_1(estimator):
    z, mask, mu, spks, cond = batch([6, 4], seed=3)
    out = solve_meanflow(estimator, mu, mask, spks, cond, z, n_timesteps=1)
    v = estimator(z, mask, mu, mx.zeros((2,)), spks, cond, r=mx.ones((2,)))
    assert close(out, z + v)


def test_two_steps_are_the_default_and_follow_the_linear_pairs(estimator):
    z, mask, mu, spks, cond = batch([5], seed=4)
    ref = z
    for t, r in ((0.0, 0.5), (0.5, 1.0)):
        ref = ref + (r - t) * estimator(ref, mask, mu, mx.full((1,), t), spks, cond, r=mx.full((1,), r))
    out = solve_meanflow(estimator, mu, mask, spks, cond, z)
    assert close(out, ref, 1e-6)
    np.testing.assert_array_equal(
        np.asarray(out), np.asarray(solve_meanflow(estimator, mu, mask, spks, cond, z, 2))
    )
    assert not close(out, solve_meanflow(estimator, mu, mask, spks, cond, z, 1), 1e-2)
    with pytest.raises(ValueError, match="at least 1"):
        solve_meanflow(estimator, mu, mask, spks, cond, z, 0)


def s3gen_of(cfg, weights: dict) -> S3Gen:
    parts = convert_s3gen({k: mx.array(v) for k, v in weights.items()}, cfg)
    nets = {}
    for name, network in (("flow", Flow), ("cfm", Estimator), ("hift", HiFT)):
        nets[name] = network(getattr(cfg, name))
        nets[name].load_weights(list(parts[name].items()), strict=True)
    return S3Gen(nets["flow"], nets["cfm"], nets["hift"])


@pytest.fixture(scope="module")
def s3gen() -> S3Gen:
    return s3gen_of(TINY_MEANFLOW, upstream_s3gen_weights(TINY_MEANFLOW, seed=1))


def tokens(n: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, 6561, (1, n)).astype(np.int32))


def test_convert_s3gen_takes_the_mixer_with_a_meanflow_config_only():
    meanflow, english = upstream_s3gen_weights(TINY_MEANFLOW), upstream_s3gen_weights(TINY_MODEL)
    key = "flow.decoder.estimator." + MIXER
    assert set(meanflow) - set(english) == {key}
    parts = convert_s3gen({k: mx.array(v) for k, v in meanflow.items()}, TINY_MEANFLOW)
    np.testing.assert_array_equal(np.asarray(parts["cfm"][MIXER]), meanflow[key])  # as is: a linear weight
    with pytest.raises(ConversionError, match="time_embed_mixer"):
        convert_s3gen({k: mx.array(v) for k, v in meanflow.items()}, TINY_MODEL)
    with pytest.raises(ConversionError, match="time_embed_mixer"):
        convert_s3gen({k: mx.array(v) for k, v in english.items()}, TINY_MEANFLOW)


def test_s3gen_runs_two_steps_by_default_and_one_works(s3gen):
    voice = random_voice(gen_tokens=6)
    mel = lambda steps: np.asarray(
        s3gen.mel(tokens(5), voice, cfm_steps=steps, key=mx.random.key(3))
    )  # noqa: E731
    default, one = mel(None), mel(1)
    np.testing.assert_array_equal(default, mel(2))
    assert default.shape == one.shape == (1, 10, 80) and np.all(np.isfinite(one))
    assert not np.allclose(default, one) and not np.allclose(default, mel(3))
    wav = s3gen(tokens(5), voice, cfm_steps=1, key=mx.random.key(3))
    assert wav.shape == (1, 4800) and np.all(np.asarray(wav)[0, :480] == 0)


def test_s3gen_uses_the_meanflow_solver_on_the_injected_noise(s3gen):
    voice = random_voice(gen_tokens=6)
    frames = 2 * (6 + 5)
    z = mx.array(np.random.default_rng(5).standard_normal((1, frames, 80)).astype(np.float32))
    mel = s3gen.mel(tokens(5), voice, cfm_noise=z)
    mu, _ = s3gen.flow.encode(mx.concatenate([voice.s3gen_prompt_tokens, tokens(5)], axis=1), mx.array([11]))
    cond = mx.concatenate([voice.s3gen_prompt_mel, mx.zeros((1, frames - 12, 80))], axis=1)
    spks = s3gen.flow.embed_speaker(voice.xvector)
    ref = solve_meanflow(s3gen.estimator, mu, None, spks, cond, z, 2)[:, 12:]
    assert close(mel, ref, 1e-6)


def test_injected_draws_replace_every_random_input(s3gen):
    voice = random_voice(gen_tokens=6)
    rng = np.random.default_rng(0)
    frames = 2 * (6 + 5)
    draws = Draws(
        cfm_noise=mx.array(rng.standard_normal((1, frames, 80)).astype(np.float32)),
        phases=mx.array(np.concatenate([[0.0], rng.uniform(-3, 3, 8)])[None].astype(np.float32)),
        source_noise=mx.array(rng.standard_normal((1, 480 * (frames - 12), 9)).astype(np.float32)),
    )
    a = np.asarray(s3gen(tokens(5), voice, draws=draws))
    mx.random.seed(123)  # the global generator must not matter
    np.testing.assert_array_equal(a, np.asarray(s3gen(tokens(5), voice, draws=draws)))
    key = np.asarray(s3gen(tokens(5), voice, key=mx.random.key(7)))
    np.testing.assert_array_equal(key, np.asarray(s3gen(tokens(5), voice, key=mx.random.key(7))))
    assert not np.allclose(a, key)


def test_batch_equals_one_by_one(s3gen):
    """S3Gen.batch supports meanflow: padded rows, their own keys, the results of single calls."""
    voices = [random_voice(seed=1, gen_tokens=6), random_voice(seed=2, gen_tokens=4)]
    ids = [tokens(7, 1), tokens(4, 2)]
    keys = [mx.random.key(10), mx.random.key(11)]
    mels = s3gen.batch_mel(ids, voices, keys=keys)
    wavs = s3gen.batch(ids, voices, cfm_steps=1, keys=keys)
    for i in range(2):
        assert close(mels[i], s3gen.mel(ids[i], voices[i], key=keys[i]), 1e-5)
        alone = s3gen(ids[i], voices[i], cfm_steps=1, key=keys[i])
        assert wavs[i].shape == alone.shape and close(wavs[i], alone, 1e-4)


def test_english_s3gen_still_runs_ten_guided_steps():
    english = s3gen_of(TINY_MODEL, upstream_s3gen_weights(TINY_MODEL, seed=1))
    voice = random_voice(gen_tokens=4)
    mel = lambda steps: np.asarray(
        english.mel(tokens(3), voice, cfm_steps=steps, key=mx.random.key(2))
    )  # noqa: E731
    np.testing.assert_array_equal(mel(None), mel(10))
