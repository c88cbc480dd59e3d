"""The S3Gen estimator's row kernels on CUDA (models/layers.py: ``add_layer_norm``, ``norm_mish``,
``causal_conv``) against MLX's composed ops (``layers.CUDA_ROWS = False``), kernel by kernel and through a whole
full-size estimator call and 10-step solve. Off CUDA the functions are the composed ops themselves, which
tests/test_cfm.py compares with upstream; these tests run where CUDA is (pytest on the H200), since CI has no GPU.
"""

from __future__ import annotations

import io
import itertools
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_chatterbox.models import layers
from mlx_chatterbox.models.cfm import CFMConfig, Estimator, solve

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend (an NVIDIA GPU)")
# Relative L2 bounds of the kernels against the composed ops: fp32 differs by summation order only; bf16 also
# by where the products' biases are added (after the product is rounded, not in cuBLAS's epilogue).
BOUNDS = {mx.float32: 1e-6, mx.bfloat16: 1e-2}
CALL_BOUNDS = {mx.float32: 1e-5, mx.bfloat16: 2e-2}


def rel_l2(a: mx.array, b: mx.array) -> float:
    a, b = np.asarray(a.astype(mx.float32), np.float64), np.asarray(b.astype(mx.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def composed(monkeypatch, f, *args, **kwargs):
    """f with the row kernels off (MLX's ops), then on."""
    monkeypatch.setattr(layers, "CUDA_ROWS", False)
    want = f(*args, **kwargs)
    mx.eval(want)
    monkeypatch.setattr(layers, "CUDA_ROWS", True)
    return want


def random_norm(rng, c: int, dtype) -> nn.LayerNorm:
    norm = nn.LayerNorm(c, eps=1e-5)
    norm.update(
        {
            "weight": mx.array(1 + 0.3 * rng.standard_normal(c), dtype),
            "bias": mx.array(0.3 * rng.standard_normal(c), dtype),
        }
    )
    return norm


def normal(rng, *shape, dtype=mx.float32, scale=1.0) -> mx.array:
    return mx.array(scale * rng.standard_normal(shape), dtype)


@cuda
@pytest.mark.parametrize(
    "dtype,c,rows", list(itertools.product([mx.float32, mx.bfloat16], [256, 512], [7, 2000]))
)
def test_add_layer_norm_kernel(monkeypatch, dtype, c, rows):
    rng = np.random.default_rng(c + rows)
    x, a = normal(rng, rows, c, dtype=dtype), normal(rng, rows, 2 * c, dtype=dtype)
    w_t, bias = normal(rng, 2 * c, c, dtype=dtype, scale=(2 * c) ** -0.5), normal(rng, c, dtype=dtype)
    norm = random_norm(rng, c, dtype)
    assert layers.rows_on_cuda(x)
    want = composed(monkeypatch, layers.add_layer_norm, x, a, w_t, bias, norm)
    got = layers.add_layer_norm(x, a, w_t, bias, norm)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == (rows, c)
        assert rel_l2(g, w) <= BOUNDS[dtype], rel_l2(g, w)


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("masked,add,residual", list(itertools.product([False, True], repeat=3)))
def test_norm_mish_kernel(monkeypatch, dtype, masked, add, residual):
    """Every combination of what ``norm_mish`` adds after Mish, with frames masked off in 2 of 3 rows (and the
    mask applied again after the sums, as the resnets' first blocks do)."""
    rng = np.random.default_rng(int(masked) + 2 * int(add) + 4 * int(residual))
    b, t, c = 3, 333, 256
    y, bias = normal(rng, b, t, c, dtype=dtype, scale=3.0), normal(rng, c, dtype=dtype)
    norm = random_norm(rng, c, dtype)
    mask = (
        mx.array((np.arange(t)[None] < np.array([t, 200, 17])[:, None])[..., None], dtype) if masked else None
    )
    kw = dict(mask=mask, mask_after=masked and add)
    kw["add"] = normal(rng, b, c, dtype=dtype) if add else None
    kw["residual"] = (normal(rng, b, t, c, dtype=dtype), normal(rng, c, dtype=dtype)) if residual else None
    want = composed(monkeypatch, layers.norm_mish, y, bias, norm, **kw)
    got = layers.norm_mish(y, bias, norm, **kw)
    assert got.dtype == dtype and got.shape == (b, t, c)
    assert rel_l2(got, want) <= BOUNDS[dtype], rel_l2(got, want)
    if masked:  # padded frames are exact zeros wherever the composed ops give them
        pad = ~np.asarray(mask.astype(mx.bool_))[..., 0]
        np.testing.assert_array_equal(
            np.asarray(got.astype(mx.float32))[pad], np.asarray(want.astype(mx.float32))[pad]
        )


@cuda
@pytest.mark.parametrize("k", [1, 3])
def test_causal_conv_pads_inside_the_convolution(monkeypatch, k):
    rng = np.random.default_rng(k)
    x, w = normal(rng, 2, 50, 320), normal(rng, 256, k, 320, scale=(320 * k) ** -0.5)
    want = composed(monkeypatch, layers.causal_conv, x, w)
    got = layers.causal_conv(x, w)
    assert got.shape == (2, 50, 256)
    assert rel_l2(got, want) <= 1e-6
    # Causal: frame 0 sees only itself.
    assert rel_l2(got[:, :1], layers.causal_conv(x[:, :1], w)) <= 1e-6


def random_estimator(seed: int = 0) -> Estimator:
    """A full-size English estimator with every parameter random (LayerNorm weights near 1, biases, Linear and
    convolution weights scaled by their fan-in), no torch needed."""
    est = Estimator(CFMConfig())
    rng = np.random.default_rng(seed)
    params = []
    for key, value in tree_flatten(est.parameters()):
        shape = value.shape
        if "norm" in key and key.endswith("weight") or ".block.2.weight" in key:
            v = 1 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            v = 0.1 * rng.standard_normal(shape)
        else:
            v = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        params.append((key, mx.array(v.astype(np.float32))))
    est.update(tree_unflatten(params))
    mx.eval(est.parameters())
    return est


@pytest.fixture(scope="module")
def estimator() -> Estimator:
    return random_estimator()


def inputs(lengths: list[int], seed: int = 0):
    rng = np.random.default_rng(seed)
    b, n = len(lengths), max(lengths)
    mask = None if len(set(lengths)) == 1 else mx.array(np.arange(n)[None] < np.array(lengths)[:, None])
    f = lambda *shape: normal(rng, *shape)  # noqa: E731
    return f(b, n, 80), mask, f(b, n, 80), f(b, 80), f(b, n, 80)  # x, mask, mu, spks, cond


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("lengths", [[530, 530], [530, 301, 77]])
def test_estimator_call_and_solve(monkeypatch, estimator, dtype, lengths):
    """One estimator call (one request with CFG's 2 rows, or a padded batch) and a 10-step solve: the kernels
    against the composed ops; with fewer primitives."""
    x, mask, mu, spks, cond = inputs(lengths)
    t = mx.full((len(lengths),), 0.4)
    estimator.set_dtype(dtype)
    try:
        args = (x.astype(dtype), mask, mu.astype(dtype), t, spks.astype(dtype), cond.astype(dtype))
        want = composed(monkeypatch, estimator, *args)
        monkeypatch.setattr(layers, "CUDA_ROWS", False)
        want_mel = solve(estimator, mu, mask, spks, cond, x)
        mx.eval(want_mel)
        plain = primitives(estimator(*args))
        monkeypatch.setattr(layers, "CUDA_ROWS", True)
        got = estimator(*args)
        fused = primitives(got)
        got_mel = solve(estimator, mu, mask, spks, cond, x)
        print(
            f"\n{dtype} {lengths}: call {rel_l2(got, want):.2e}, mel {rel_l2(got_mel, want_mel):.2e}, "
            f"primitives {plain} -> {fused}"
        )
        assert rel_l2(got, want) <= CALL_BOUNDS[dtype]
        assert rel_l2(got_mel, want_mel) <= CALL_BOUNDS[dtype]
        assert fused < plain
        if mask is not None:
            valid = np.asarray(mask)
            assert not np.asarray(got.astype(mx.float32))[~valid].any()  # zero on padded frames
    finally:
        estimator.set_dtype(mx.float32)


def primitives(out: mx.array) -> int:
    """The primitives of out's graph (its unevaluated arrays), as MLX exports them."""
    f = io.StringIO()
    mx.export_to_dot(f, out)
    return len(re.findall(r'label ="[^"]+", shape=rectangle', f.getvalue()))
