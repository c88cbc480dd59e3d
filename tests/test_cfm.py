"""The flow-matching decoder on tiny random configs (no torch): key table, shapes, masks with padded batches,
odd lengths, the schedule and the Euler/CFG solver."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_chatterbox.convert import sanitize
from mlx_chatterbox.models import cfm, layers
from mlx_chatterbox.models.cfm import CFMConfig, Estimator, cosine_schedule, solve

# An 8-bin "mel" keeps it fast; the inner attention width (2 x 8) differs from the 24 channels.
TINY = CFMConfig(
    in_channels=32, out_channels=8, channels=24, n_blocks=1, num_mid_blocks=2, num_heads=2, head_dim=8
)
MEL = TINY.out_channels


def random_upstream_weights(cfg: CFMConfig, seed: int = 0) -> dict[str, mx.array]:
    """Random tensors under upstream's keys and PyTorch shapes: LayerNorm weights 1 + 0.1·N, biases 0.1·N,
    weights N / sqrt(fan_in)."""
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


@pytest.fixture(scope="module")
def estimator() -> Estimator:
    model = Estimator(TINY)
    table = Estimator.checkpoint_table(TINY)
    model.load_weights(list(sanitize(random_upstream_weights(TINY), table, "test").items()), strict=True)
    mx.eval(model.parameters())
    return model


def batch(lengths: list[int], seed: int = 0, n: int | None = None):
    rng = np.random.default_rng(seed)
    b, n = len(lengths), n or max(lengths)
    f = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    mask = mx.array(np.arange(n)[None] < np.array(lengths)[:, None])
    return f(b, n, MEL), mask, f(b, n, MEL), f(b, MEL), f(b, n, MEL)  # x, mask, mu, spks, cond


def close(a: mx.array, b: mx.array, tol: float = 1e-5) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max()) <= tol * max(float(np.abs(b).max()), 1e-12)


def test_config_defaults_are_upstreams_and_round_trip_through_json():
    cfg = CFMConfig()
    assert (cfg.in_channels, cfg.out_channels, cfg.channels, cfg.time_embed_dim) == (320, 80, 256, 1024)
    assert (cfg.n_blocks, cfg.num_mid_blocks, cfg.num_heads, cfg.head_dim) == (4, 12, 8, 64)
    assert (cfg.n_timesteps, cfg.cfg_rate) == (10, 0.7)
    with pytest.raises(ValueError, match="4 x out_channels"):
        CFMConfig(in_channels=300)


def test_checkpoint_table_matches_our_parameters():
    for cfg in (TINY, CFMConfig()):
        table = Estimator.checkpoint_table(cfg)
        ours = dict(tree_flatten(Estimator(cfg).parameters()))
        assert {rule[0] for rule in table.values()} == set(ours)
        for key, (target, shape, *layout) in table.items():
            expected = (shape[0], shape[2], shape[1]) if layout == ["conv1d"] else shape
            assert ours[target].shape == expected, key
    assert len(Estimator.checkpoint_table(CFMConfig())) == 910  # the full model's key count


def test_output_shape_and_padded_frames_are_zero(estimator):
    x, mask, mu, spks, cond = batch([9, 4])
    out = estimator(x, mask, mu, mx.array([0.2, 0.2]), spks, cond)
    assert out.shape == (2, 9, MEL) and out.dtype == mx.float32
    assert np.all(np.asarray(out)[1, 4:] == 0)
    assert np.all(np.isfinite(np.asarray(out)))


def test_float_mask_equals_bool_mask(estimator):
    x, mask, mu, spks, cond = batch([7, 5], seed=1)
    t = mx.array([0.5, 0.9])
    a = estimator(x, mask, mu, t, spks, cond)
    b = estimator(x, mask.astype(mx.float32), mu, t, spks, cond)
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_no_mask_equals_an_all_valid_mask(estimator):
    x, mask, mu, spks, cond = batch([9, 9], seed=2)
    t = mx.array([0.3, 0.8])
    assert close(estimator(x, None, mu, t, spks, cond), estimator(x, mask, mu, t, spks, cond), 1e-6)
    z = mx.array(np.random.default_rng(3).standard_normal(x.shape).astype(np.float32))
    assert close(
        solve(estimator, mu, None, spks, cond, z, 3), solve(estimator, mu, mask, spks, cond, z, 3), 1e-6
    )


@pytest.mark.parametrize("length", [1, 3, 6])
def test_valid_frames_of_a_padded_row_equal_the_unpadded_run(estimator, length):
    """Causal convolutions, per-frame norms and key-padding attention make padding invisible to the valid
    frames, whatever the padded frames hold."""
    x, mask, mu, spks, cond = batch([11, length], seed=2)
    t = mx.array([0.3, 0.7])
    padded = estimator(x, mask, mu, t, spks, cond)
    alone = estimator(
        x[1:, :length], mx.ones((1, length), mx.bool_), mu[1:, :length], t[1:], spks[1:], cond[1:, :length]
    )
    assert close(padded[1, :length], alone[0])
    # and row 0 does not see row 1
    first = estimator(x[:1], mask[:1], mu[:1], t[:1], spks[:1], cond[:1])
    assert close(padded[0], first[0])


def test_attention_is_bidirectional(estimator):
    """Only the convolutions are causal (architecture §9.1): a change in the last frame reaches earlier
    frames through attention."""
    x, mask, mu, spks, cond = batch([8], seed=3)
    t = mx.array([0.4])
    base = estimator(x, mask, mu, t, spks, cond)
    bumped_x = mx.concatenate([x[:, :-1], x[:, -1:] + 1.0], axis=1)
    bumped = estimator(bumped_x, mask, mu, t, spks, cond)
    assert not close(bumped[:, :-1], base[:, :-1], 1e-3)


@pytest.mark.parametrize("n", [1, 2, 7])
def test_odd_and_tiny_lengths(estimator, n):
    x, mask, mu, spks, cond = batch([n], seed=4)
    out = estimator(x, mask, mu, mx.array([0.1]), spks, cond)
    assert out.shape == (1, n, MEL) and np.all(np.isfinite(np.asarray(out)))


def test_cosine_schedule():
    for n in (1, 2, 10, 33):
        t = np.asarray(cosine_schedule(n))
        assert t.shape == (n + 1,) and t.dtype == np.float32
        assert t[0] == 0 and t[-1] == 1 and np.all(np.diff(t) > 0)
        exact = 1 - np.cos(np.pi / 2 * np.arange(n + 1) / n)
        assert np.abs(t - exact).max() < 2e-7


def test_one_step_is_one_guided_euler_step(estimator):
    x, mask, mu, spks, cond = batch([6, 4], seed=5)
    z = x
    out = solve(estimator, mu, mask, spks, cond, z, n_timesteps=1, cfg_rate=0.7)
    t0 = mx.zeros((2,))
    v_cond = estimator(z, mask, mu, t0, spks, cond)
    v_uncond = estimator(z, mask, mx.zeros_like(mu), t0, mx.zeros_like(spks), mx.zeros_like(cond))
    assert close(out, z + 1.7 * v_cond - 0.7 * v_uncond)


def test_ten_steps_follow_the_schedule(estimator):
    x, mask, mu, spks, cond = batch([5], seed=6)
    w, n = 0.5, 10
    t = np.asarray(cosine_schedule(n))
    ref = x
    for k in range(n):
        tk = mx.full((1,), float(t[k]))
        v = (1 + w) * estimator(ref, mask, mu, tk, spks, cond) - w * estimator(
            ref, mask, mx.zeros_like(mu), tk, mx.zeros_like(spks), mx.zeros_like(cond)
        )
        ref = ref + float(t[k + 1] - t[k]) * v
    out = solve(estimator, mu, mask, spks, cond, x, n_timesteps=n, cfg_rate=w)
    one = solve(estimator, mu, mask, spks, cond, x, n_timesteps=1, cfg_rate=w)
    assert close(out, ref, 1e-4)
    assert not close(out, one, 1e-2)


def test_steps_held_in_flight_change_no_number(estimator, monkeypatch):
    """``in_flight`` only waits: the same sample bit for bit, and step k is built only after step k - n - 1 was
    waited for."""
    x, mask, mu, spks, cond = batch([6, 4], seed=9)
    free = solve(estimator, mu, mask, spks, cond, x, n_timesteps=4)
    waits, real = [], mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: waits.append(len(a)) or real(*a))
    held = solve(estimator, mu, mask, spks, cond, x, n_timesteps=4, in_flight=1)
    monkeypatch.undo()
    assert waits == [1, 1]  # before steps 3 and 4: steps 1 and 2
    assert np.array_equal(np.asarray(held), np.asarray(free))
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="in_flight=.* must be a number of steps >= 1, or None"):
            solve(estimator, mu, mask, spks, cond, x, n_timesteps=2, in_flight=bad)


def test_solver_leaves_padded_frames_at_the_noise_and_rows_independent(estimator):
    """The estimator is zero on padded frames and upstream does not re-mask x, so they keep the noise."""
    z, mask, mu, spks, cond = batch([9, 5], seed=7)
    out = solve(estimator, mu, mask, spks, cond, z, n_timesteps=3)
    assert np.array_equal(np.asarray(out)[1, 5:], np.asarray(z)[1, 5:])
    alone = solve(estimator, mu[1:, :5], mask[1:, :5], spks[1:], cond[1:, :5], z[1:, :5], n_timesteps=3)
    assert close(out[1, :5], alone[0], 1e-4)


def test_no_guidance_is_the_conditional_flow(estimator):
    z, mask, mu, spks, cond = batch([6], seed=8)
    out = solve(estimator, mu, mask, spks, cond, z, n_timesteps=1, cfg_rate=0.0)
    assert close(out, z + estimator(z, mask, mu, mx.zeros((1,)), spks, cond))
    with pytest.raises(ValueError, match="at least 1"):
        solve(estimator, mu, mask, spks, cond, z, n_timesteps=0)


def test_a_bf16_estimator_runs_in_bf16_and_the_sample_stays_float32(estimator):
    from mlx.utils import tree_flatten

    z, mask, mu, spks, cond = batch([7, 4], seed=3)
    exact = solve(estimator, mu, mask, spks, cond, z, n_timesteps=2)
    low = Estimator(estimator.config)
    low.update(estimator.parameters())
    low.set_dtype(mx.bfloat16)
    assert low.dtype == mx.bfloat16 and all(v.dtype == mx.bfloat16 for _, v in tree_flatten(low.parameters()))
    out = solve(low, mu, mask, spks, cond, z, n_timesteps=2)
    assert out.dtype == mx.float32
    # bf16 rounding shows, but the result stays near (the budget on the full-size model: test_cfm_parity).
    assert close(out, exact, 0.1) and not close(out, exact, 1e-5)


def build(seed: int) -> Estimator:
    model = Estimator(TINY)
    table = Estimator.checkpoint_table(TINY)
    weights = sanitize(random_upstream_weights(TINY, seed), table, "test")
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def test_fused_qkv_equals_the_three_projections(estimator):
    """Attention takes q, k, v as one product against the weights side by side; the three separate linears
    (upstream's computation) give the same output, plus the residual, within 1e-6 of its largest value in fp32.
    """
    block = estimator.mid_blocks[0][1][0]
    attn = block.attn1
    b, n, bias = 2, 7, mx.array([[0.0] * 7, [0.0] * 5 + [-1e10] * 2])[:, None, None, :]
    x = mx.array(np.random.default_rng(3).standard_normal((b * n, TINY.channels)).astype(np.float32))

    def heads(linear):  # nn.Linear's own call: norm1(x) @ W.T
        return (
            nn.Linear.__call__(linear, block.norm1(x)).reshape(b, n, attn.num_heads, -1).transpose(0, 2, 1, 3)
        )

    out = mx.fast.scaled_dot_product_attention(
        heads(attn.to_q), heads(attn.to_k), heads(attn.to_v), scale=attn.head_dim**-0.5, mask=bias
    )
    ref = nn.Linear.__call__(attn.to_out[0], out.transpose(0, 2, 1, 3).reshape(b * n, -1)) + x
    assert close(attn(x, b, bias, residual=x, norm=block.norm1), ref, 1e-6)


def test_kept_weights_are_not_parameters_and_follow_weight_changes(tmp_path):
    """The fused q/k/v weight and the transposed weights are kept outside the parameter tree (keys, strict
    loading and saved files stay the checkpoint's), and are rebuilt when the weights are replaced: set_dtype
    and load_weights give what a module built with those weights gives, bit for bit."""
    model, x, mask, mu, spks, cond = build(0), *batch([6, 4])
    t = mx.array([0.3, 0.3])

    def run(m: Estimator, dtype=mx.float32) -> np.ndarray:
        xd, mud, spksd, condd = (a.astype(dtype) for a in (x, mu, spks, cond))
        return np.asarray(m(xd, mask, mud, t, spksd, condd).astype(mx.float32))

    first = run(model)
    attn = model.mid_blocks[0][1][0].attn1
    assert isinstance(attn.__dict__.get("_qkv"), layers.Kept)  # the call kept it ...
    keys = set(Estimator.checkpoint_table(TINY))
    assert {k for k, _ in tree_flatten(model.parameters())} == keys  # ... outside the parameters
    path = str(tmp_path / "w.safetensors")
    model.save_weights(path)
    assert set(mx.load(path)) == keys
    model.load_weights(path, strict=True)
    assert np.array_equal(run(model), first)

    fresh = build(0)
    model.set_dtype(mx.bfloat16)
    fresh.set_dtype(mx.bfloat16)
    assert np.array_equal(run(model, mx.bfloat16), run(fresh, mx.bfloat16))
    assert attn.qkv_weight().dtype == mx.bfloat16
    # Back to fp32 the weights are the bf16-rounded ones: compare with a fresh module rounded the same way.
    model.set_dtype(mx.float32)
    fresh.set_dtype(mx.float32)
    assert np.array_equal(run(model), run(fresh))

    other = build(1)
    model.load_weights(tree_flatten(other.parameters()), strict=True)
    assert np.array_equal(run(model), run(other))
    assert not close(mx.array(run(model)), mx.array(first), 1e-2)


def test_stacked_weights_share_the_memory_of_the_parameters():
    """q/k/v stacked once for the fused product: the three weights become views of the stack, which then costs
    no memory beside them (a copy would be 768 KiB here), and are equal to what they were."""
    attn = cfm.Attention(256, 4, 64)
    mx.eval(attn.parameters())
    old = [np.array(attn[name]["weight"]) for name in ("to_q", "to_k", "to_v")]
    before = mx.get_active_memory()
    w = attn.qkv_weight()
    assert w.shape == (768, 256) and mx.get_active_memory() - before < w.nbytes // 4
    assert attn.qkv_weight() is w  # kept
    for name, weight in zip(("to_q", "to_k", "to_v"), old):
        assert np.array_equal(np.array(attn[name]["weight"]), weight)
    assert {k for k, _ in tree_flatten(attn.parameters())} == {
        "to_q.weight",
        "to_k.weight",
        "to_v.weight",
        "to_out.0.weight",
        "to_out.0.bias",
    }


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gelu_linear_off_the_cpu_fast_path_equals_addmm_then_gelu(monkeypatch, dtype):
    """The GPU's path (MLX's own math): in fp32 the bias goes inside the compiled GELU, the same sums bit for
    bit; bf16 keeps addmm's single rounding."""
    monkeypatch.setattr(layers, "FAST_CPU_MATH", False)
    rng = np.random.default_rng(4)
    x, w_t, bias = (
        mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        for shape in ((37, 24), (24, 96), (96,))
    )
    ours = layers.gelu_linear(x, w_t, bias).astype(mx.float32)
    assert np.array_equal(np.asarray(ours), np.asarray(nn.gelu(mx.addmm(bias, x, w_t)).astype(mx.float32)))
