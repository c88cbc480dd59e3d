"""Key/value buffers for T3's autoregressive decoding."""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Every layer's keys and values in buffers (B, heads, capacity, head_dim), ``kv = [keys_0, values_0,
    keys_1, ...]``, of which the first ``offset`` positions are written.

    The capacity grows ``step`` positions at a time, so that a decode step writes in place and has the same
    shapes for ``step`` tokens in a row: a compiled step is traced once per capacity, not once per token, and
    attention reads at most ``step - 1`` unwritten (masked) positions.
    """

    def __init__(self, kv: list[mx.array], offset: int, step: int = 256):
        self.kv, self.offset, self.step = kv, offset, step

    @classmethod
    def from_prefill(cls, kv: list[mx.array], step: int = 256) -> KVCache:
        """Buffers holding the prefill's (B, H, N, hd) keys and values at positions 0 .. N - 1."""
        cache = cls([], kv[0].shape[2], step)
        cache.kv = [cache._padded(a, cache._capacity_for(cache.offset + 1)) for a in kv]
        return cache

    @property
    def capacity(self) -> int:
        return self.kv[0].shape[2]

    def claim(self) -> int:
        """The position the next decode step writes: room is made for it and ``offset`` moves past it."""
        self.reserve(self.offset + 1)
        self.offset += 1
        return self.offset - 1

    def reserve(self, end: int) -> None:
        """Make room for positions up to ``end`` (exclusive), growing every buffer by whole steps."""
        if end > self.capacity:
            capacity = self._capacity_for(end)
            self.kv = [self._padded(a, capacity) for a in self.kv]

    def _capacity_for(self, end: int) -> int:
        return -(-end // self.step) * self.step

    @staticmethod
    def _padded(a: mx.array, capacity: int) -> mx.array:
        return mx.pad(a, [(0, 0), (0, 0), (0, capacity - a.shape[2]), (0, 0)])


class BatchKVCache(KVCache):
    """``KVCache`` buffers for rows of different lengths, each right-aligned so that all rows write their next
    token at the same buffer index ``offset``: row b's sequence starts at ``pad[b]`` (left padding, masked).

    Rows join (``extend``) and leave (``keep``) between decode steps, which is continuous batching.
    """

    def __init__(self, kv: list[mx.array], offset: int, pad: list[int], step: int = 256):
        super().__init__(kv, offset, step)
        self.pad = pad

    @classmethod
    def from_cache(cls, cache: KVCache) -> BatchKVCache:
        return cls(cache.kv, cache.offset, [0] * cache.kv[0].shape[0], cache.step)

    def extend(self, other: BatchKVCache) -> None:
        """Append ``other``'s rows after this cache's, both shifted right to the later of the two ends."""
        end = max(self.offset, other.offset)
        mine, theirs = self._shifted(end - self.offset), other._shifted(end - other.offset)
        capacity = max(self._capacity_for(end + 1), mine[0].shape[2], theirs[0].shape[2])
        self.kv = [
            mx.concatenate([self._padded(a, capacity), self._padded(b, capacity)], axis=0)
            for a, b in zip(mine, theirs)
        ]
        self.pad = [p + end - self.offset for p in self.pad] + [p + end - other.offset for p in other.pad]
        self.offset = end

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order), then drop the left padding that all of them share."""
        index = mx.array(rows, dtype=mx.int32)
        trim = min(self.pad[r] for r in rows)
        self.kv = [a[index, :, trim:] for a in self.kv]
        self.pad = [self.pad[r] - trim for r in rows]
        self.offset -= trim

    def _shifted(self, n: int) -> list[mx.array]:
        """The buffers with ``n`` masked positions in front (nothing when n is 0)."""
        if n == 0:
            return self.kv
        return [mx.pad(a, [(0, 0), (0, 0), (n, 0), (0, 0)]) for a in self.kv]
