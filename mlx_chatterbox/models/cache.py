"""Key/value cache for autoregressive decoding (mlx-lm's interface: ``update_and_fetch``, ``offset``)."""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Per-layer keys and values (B, heads, T, head_dim), stored in buffers that grow ``step`` positions at a
    time so that a decode step writes in place instead of concatenating."""

    def __init__(self, step: int = 256):
        self.step = step
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        end = self.offset + keys.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            capacity = -(-end // self.step) * self.step
            b, h, _, d = keys.shape
            new_keys = mx.zeros((b, h, capacity, d), keys.dtype)
            new_values = mx.zeros((b, h, capacity, values.shape[3]), values.dtype)
            if self.keys is not None:
                new_keys[:, :, : self.offset] = self.keys[:, :, : self.offset]
                new_values[:, :, : self.offset] = self.values[:, :, : self.offset]
            self.keys, self.values = new_keys, new_values
        self.keys[:, :, self.offset : end] = keys
        self.values[:, :, self.offset : end] = values
        self.offset = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]
