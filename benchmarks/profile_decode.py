"""Where a batched T3 decode step's time goes, part by part, at several row counts (a one-off profile for the
H200; see bench_batch.py --profile for the whole step). Each part is compiled alone and queued ``--iters``
times in a row (each call depending on the last), so the time per call is whichever of host and device is
slower."""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx_chatterbox  # noqa: F401  isort: skip

import argparse
import time

import mlx.core as mx

from mlx_chatterbox.models.layers import BufferState, WindowState
from mlx_chatterbox.models.t3 import T3, T3Config


def timed(fn, x, iters: int) -> float:
    x = fn(x)
    mx.eval(x)
    start = time.perf_counter()
    for _ in range(iters):
        x = fn(x)
        mx.async_eval(x)
    mx.eval(x)
    return 1000 * (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="2,16,128")
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--window", type=int, default=32, help="positions in BatchKVCache's window")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    cfg = T3Config()
    model = T3(cfg)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    layer = model.tfmr.layers[0]
    attn = layer.self_attn
    h, hd, d = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    print("| rows | part | ms per call |\n|---|---|---|")
    for b in (int(r) for r in args.rows.split(",")):
        cap = args.capacity
        kv = [mx.random.normal((b, h, cap, hd)).astype(dtype) for _ in range(2 * cfg.num_layers)]
        x = mx.random.normal((b, 1, d)).astype(dtype)
        pos = mx.array(cap - 10, dtype=mx.int32)
        pad = mx.array([i % 37 for i in range(b)], dtype=mx.int32)
        q = mx.random.normal((b, h, 1, hd)).astype(dtype)
        mask = (mx.arange(cap) <= pos) & (mx.arange(cap) >= pad[:, None])
        mask = mask[:, None, None]
        # The batch path (BatchKVCache): big buffers read only, the newest positions in a small window.
        w = args.window
        base = pos - w // 2
        at = mx.stack([pos, base])
        window = [mx.random.normal((b, h, w, hd)).astype(dtype) for _ in range(2 * cfg.num_layers)]

        def flush(s: mx.array) -> mx.array:
            s = mx.array(s)
            s[:, :, cap - 2 * w : cap - w] = window[0]  # as BatchKVCache.flush: a static-index update
            return s

        def one_layer(h: mx.array, state: BufferState | WindowState) -> tuple[mx.array, ...]:
            h, state = layer.decode(h, state)
            return (h, *state.written)

        parts = {
            "llama decode, pad": (
                mx.compile(lambda s: model.tfmr.decode(s[0], BufferState.per_layer(s[1], pos, pad, "llama"))),
                (x, kv),
            ),
            "llama decode, no pad": (
                mx.compile(
                    lambda s: model.tfmr.decode(s[0], BufferState.per_layer(s[1], pos, None, "llama"))
                ),
                (x, kv),
            ),
            "one layer, pad": (
                mx.compile(lambda s: one_layer(s[0], BufferState(s[1], s[2], pos, pad))),
                (x, kv[0], kv[1]),
            ),
            "llama decode_window, pad": (
                mx.compile(lambda s: model.tfmr.decode(s[0], WindowState.per_layer(kv, s[1], at, pad))),
                (x, window),
            ),
            "one layer decode_window, pad": (
                mx.compile(lambda s: one_layer(s[0], WindowState(kv[0], kv[1], s[1], s[2], at, pad))),
                (x, window[0], window[1]),
            ),
            "one layer mlp": (mx.compile(lambda s: layer.mlp(s)), x),
            "one layer qkv+o matmuls": (mx.compile(lambda s: attn.o_proj(attn.qkv_proj(s)[..., :d])), x),
            "sdpa bool mask": (
                mx.compile(
                    lambda s: mx.fast.scaled_dot_product_attention(s, kv[0], kv[1], scale=0.125, mask=mask)
                ),
                q,
            ),
            "sdpa no mask": (
                mx.compile(lambda s: mx.fast.scaled_dot_product_attention(s, kv[0], kv[1], scale=0.125)),
                q,
            ),
            "rope array offset": (
                mx.compile(lambda s: attn._rope(s, pos - pad)),
                mx.random.normal((b, 2, h, 1, hd)).astype(dtype),
            ),
            "rope scalar offset": (
                mx.compile(lambda s: attn._rope(s, pos)),
                mx.random.normal((b, 2, h, 1, hd)).astype(dtype),
            ),
            "slice_update kv": (mx.compile(lambda s: mx.slice_update(s, q, pos[None], axes=(2,))), kv[0]),
            "slice_update window": (
                mx.compile(lambda s: mx.slice_update(s, q, (pos - base)[None], axes=(2,))),
                window[0],
            ),
            # Once per --window steps per buffer (2 x layers buffers): divide by the window for a step's share.
            "window flush into kv": (flush, kv[0]),
        }
        for name, (fn, state) in parts.items():
            ms = timed(fn if isinstance(state, mx.array) else (lambda s, fn=fn: fn(s)), state, args.iters)
            print(f"| {b} | {name} | {ms:.3f} |", flush=True)


if __name__ == "__main__":
    main()
