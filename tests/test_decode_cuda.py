"""The decode-step paths of models/layers.py that CUDA takes (ADR 12): few-row projections as matrix-vector
products and our single-query attention kernel. The composed forms are checked here on any device; the kernel
and the dispatch only where CUDA is (run with pytest on the H200), since CI has no GPU.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_chatterbox.models import layers
from mlx_chatterbox.models.gpt2 import T3Turbo, T3TurboConfig
from mlx_chatterbox.models.t3 import T3, T3Config

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend (an NVIDIA GPU)")


def reference_attention(q, keys, values, position, pad=None) -> np.ndarray:
    """Softmax attention over indices pad[b] .. position in float64."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, keys, values))
    b, h, _, hd = q.shape
    out = np.zeros_like(q)
    for i in range(b):
        first = 0 if pad is None else int(pad[i])
        scores = q[i] @ k[i, :, first : position + 1].transpose(0, 2, 1) / np.sqrt(hd)  # (H, 1, n)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[i] = (p / p.sum(-1, keepdims=True)) @ v[i, :, first : position + 1]
    return out


def attention_inputs(seed: int, b: int = 2, h: int = 3, capacity: int = 256, hd: int = 64):
    rng = np.random.default_rng(seed)
    q, keys, values = (
        rng.standard_normal(s).astype(np.float32) for s in [(b, h, 1, hd)] + [(b, h, capacity, hd)] * 2
    )
    return q, keys, values


def test_few_rows_linear_is_the_linear():
    rng = np.random.default_rng(0)
    lin = nn.Linear(64, 96)
    lin.update(
        {
            "weight": mx.array(rng.standard_normal((96, 64)), mx.float32),
            "bias": mx.array(rng.standard_normal(96), mx.float32),
        }
    )
    for shape in [(1, 1, 64), (2, 1, 64), (4, 64)]:
        x = mx.array(rng.standard_normal(shape), mx.float32)
        got = layers.few_rows_linear(x, lin.weight, lin.bias)
        assert got.shape == shape[:-1] + (96,)
        np.testing.assert_allclose(np.array(got), np.array(lin(x)), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            np.array(layers.few_rows_linear(x, lin.weight)), np.array(x @ lin.weight.T), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("with_pad", [False, True])
def test_decode_attention_composed(with_pad):
    q, keys, values = attention_inputs(1)
    position, pad = 200, (np.array([0, 37]) if with_pad else None)
    got = layers.decode_attention(
        mx.array(q),
        mx.array(keys),
        mx.array(values),
        mx.array(position, mx.int32),
        None if pad is None else mx.array(pad, mx.int32),
        kernel=False,
    )
    np.testing.assert_allclose(
        np.array(got), reference_attention(q, keys, values, position, pad), rtol=1e-5, atol=1e-5
    )


@cuda
@pytest.mark.parametrize("dtype,tol", [(mx.float32, 2e-6), (mx.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_pad", [False, True])
@pytest.mark.parametrize("position", [0, 5, 255, 700])
def test_decode_attention_kernel_equals_composed(dtype, tol, with_pad, position):
    q, keys, values = attention_inputs(position, b=3, h=16, capacity=768)
    # A row's own token is always visible: its padding ends at or before the position.
    pad = np.array([0, min(position, 3), min(position, 50)]) if with_pad else None
    args = [mx.array(a).astype(dtype) for a in (q, keys, values)]
    args += [mx.array(position, mx.int32), None if pad is None else mx.array(pad, mx.int32)]
    kernel = layers.decode_attention(*args, kernel=True).astype(mx.float32)
    composed = layers.decode_attention(*args, kernel=False).astype(mx.float32)
    err = (mx.linalg.norm(kernel - composed) / mx.linalg.norm(composed)).item()
    assert err <= tol, err
    if dtype == mx.float32:
        np.testing.assert_allclose(
            np.array(kernel), reference_attention(q, keys, values, position, pad), rtol=1e-5, atol=1e-5
        )


@cuda
def test_linear_takes_matrix_vector_products_on_cuda():
    lin = layers.Linear(1024, 3072)
    for rows in (1, 2, layers.GEMV_ROWS, layers.GEMV_ROWS + 1):
        x = mx.random.normal((rows, 1, 1024))
        ref = x @ lin.weight.T + lin.bias
        err = (mx.linalg.norm(lin(x) - ref) / mx.linalg.norm(ref)).item()
        assert err <= 1e-6, (rows, err)


def decode_logits(model, embeds: mx.array, tokens: list[int]) -> mx.array:
    """Prefill, then the tokens fed one by one through ``model.decode`` (T3's or T3Turbo's): every logit row."""
    logits, cache = model.prefill(embeds)
    out = [logits]
    for i, token in enumerate(tokens):
        token = mx.full((embeds.shape[0],), token, dtype=mx.int32)
        position = mx.array(cache.claim(), dtype=mx.int32)
        if isinstance(model, T3):
            logits, cache.kv = model.decode(token, mx.array(i + 1, dtype=mx.int32), position, cache.kv)
        else:
            logits, cache.kv = model.decode(token, position, cache.kv)
        out.append(logits)
    return mx.stack(out)


@cuda
@pytest.mark.parametrize("which", ["t3", "turbo"])
def test_decode_steps_equal_with_and_without_cuda_paths(which, monkeypatch):
    """Whole decode steps (head dim 64, so the kernel runs; CFG's 2 rows or Turbo's 1) match the same steps
    through MLX's own ops, which the parity tests compare with upstream."""
    mx.random.seed(3)
    if which == "t3":
        model = T3(T3Config(hidden_size=256, num_layers=3, num_heads=4, head_dim=64, intermediate_size=512))
        embeds = mx.random.normal((2, 40, 256))
    else:
        model = T3Turbo(T3TurboConfig(hidden_size=256, num_layers=3, num_heads=4, n_positions=600))
        embeds = mx.random.normal((1, 40, 256))
    tokens = [int(t) for t in mx.random.randint(0, 6561, (300,))]  # past one 256-position capacity step
    monkeypatch.setattr(layers, "CUDA_DECODE", False)
    composed = decode_logits(model, embeds, tokens)
    monkeypatch.setattr(layers, "CUDA_DECODE", True)
    fused = decode_logits(model, embeds, tokens)
    err = (mx.linalg.norm(fused - composed) / mx.linalg.norm(composed)).item()
    assert err <= 1e-5, err


@cuda
@pytest.mark.parametrize("dtype,tol", [(mx.float32, 2e-6), (mx.bfloat16, 1e-2)])
@pytest.mark.parametrize("position", [40, 63, 300])
def test_window_attention_kernel_equals_composed(dtype, tol, position):
    """The batch cache's attention (models/cache.py BatchKVCache): big buffers before base, a window after."""
    rng = np.random.default_rng(position)
    b, h, capacity, window, hd = 3, 16, 512, 32, 64
    base = position - position % window if position % window else position - 5
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(b, h, 1, hd)] * 3]
    arrays += [rng.standard_normal((b, h, capacity, hd)).astype(np.float32) for _ in range(2)]
    arrays += [rng.standard_normal((b, h, window, hd)).astype(np.float32) for _ in range(2)]
    q, k, v, keys, values, wk, wv = (mx.array(a).astype(dtype) for a in arrays)
    at = mx.array([position, base], mx.int32)
    pad = mx.array([0, 7, min(base - 1, 30)], mx.int32)
    fused = layers.window_attention(q, k, v, at, pad, keys, values, wk, wv, kernel=True)
    composed = layers.window_attention(q, k, v, at, pad, keys, values, wk, wv, kernel=False)
    for got, want in zip(fused, composed):
        got, want = got.astype(mx.float32), want.astype(mx.float32)
        err = (mx.linalg.norm(got - want) / mx.linalg.norm(want)).item()
        assert err <= tol, err


def rel_l2(got: mx.array, want: np.ndarray) -> float:
    got = np.array(got, dtype=np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_add_to_and_swiglu_composed():
    """Their values on any device (on CUDA through our kernel; elementwise bounds would trip on outputs that
    cancel to near 0, whose sums come out in another order there)."""
    rng = np.random.default_rng(5)
    lin = layers.Linear(128, 256, bias=False)
    w = rng.standard_normal((256, 128))
    lin.update({"weight": mx.array(w, mx.float32)})
    x, res = rng.standard_normal((2, 1, 128)), rng.standard_normal((2, 1, 256))
    product = x @ w.T  # float64
    assert (
        rel_l2(layers.add_to(lin, mx.array(x, mx.float32), mx.array(res, mx.float32)), res + product) <= 1e-6
    )
    gate, up = np.split(product, 2, axis=-1)
    assert rel_l2(layers.swiglu(lin, mx.array(x, mx.float32)), gate / (1 + np.exp(-gate)) * up) <= 1e-6


@cuda
@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-6), (mx.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_fused_gemv_kernel_equals_composed(dtype, tol, rows, monkeypatch):
    lin = layers.Linear(1024, 2048)
    lin.set_dtype(dtype)
    x = mx.random.normal((rows, 1, 1024)).astype(dtype)
    res = mx.random.normal((rows, 1, 2048)).astype(dtype)
    calls = {
        "add_to": lambda: layers.add_to(lin, x, res),
        "swiglu": lambda: layers.swiglu(lin, x),
        "plain": lambda: lin(x),
    }
    fused = {name: f() for name, f in calls.items()}
    monkeypatch.setattr(layers, "CUDA_DECODE", False)
    for name, f in calls.items():
        want = f().astype(mx.float32)
        err = (mx.linalg.norm(fused[name].astype(mx.float32) - want) / mx.linalg.norm(want)).item()
        assert err <= tol, (name, err)
