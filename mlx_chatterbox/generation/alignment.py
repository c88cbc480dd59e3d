"""Multilingual v2's alignment analyzer: reads where three attention heads of T3 look in the text and, from that,
forbids or forces the stop token (upstream 0.1.7 ``AlignmentStreamAnalyzer``; variants.md §5.8).

The analyzer here is a plain object made per generation call, fed the heads' probabilities that the pass computed
(``models.t3.AttentionTaps``): no hooks on the model, no switch of its attention, no state shared between calls
(upstream's hooks and its eager-attention switch outlive the call, variants.md §6 row 11).

One deviation: upstream's alignment-repetition rule reduces over the text columns before the last 5, which is
empty for 5 text tokens or fewer (SOT and EOT included), and raises IndexError there once the alignment reaches
the end (upstream #548). The rule is skipped at that size (False), as its EOS suppression already is. The rest
follows upstream, the force-EOS-on-2-equal-tokens rule included (#549; its comment says 3x).
Upstream also computes ``false_start`` and the last text token's duration, which change nothing: left out.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

logger = logging.getLogger(__name__)

# (layer, head) pairs whose attention follows the text (upstream ``LLAMA_ALIGNED_HEADS``), in upstream's order.
ALIGNED_HEADS: tuple[tuple[int, int], ...] = ((12, 15), (13, 11), (9, 2))

# Upstream's logit values for a forbidden and a forced token (±2**15 is safe for every dtype of 16 bits or more).
_LOGIT_CAP = 2.0**15


@dataclass(frozen=True)
class AlignmentVerdict:
    """What one step of the analyzer does to the stop token's logit: ``force_eos`` wins over ``suppress_eos``.
    The three reasons for forcing are kept for logs and tests."""

    suppress_eos: bool = False
    long_tail: bool = False
    alignment_repetition: bool = False
    token_repetition: bool = False

    @property
    def force_eos(self) -> bool:
        return self.long_tail or self.alignment_repetition or self.token_repetition


class AlignmentAnalyzer:
    """The per-call state of upstream's analyzer for a prefill whose text (SOT and EOT included) sits at
    positions ``text_start`` .. ``text_end - 1``. ``step`` is called once per decode step, with the tapped heads'
    probabilities of the pass that gave that step's logits."""

    def __init__(self, text_start: int, text_end: int):
        if not 0 <= text_start < text_end:
            raise ValueError(f"the text span must be non-empty, got positions {text_start} .. {text_end - 1}")
        self.text_start, self.text_end = text_start, text_end
        self.frame = 0  # upstream ``curr_frame_pos``: steps taken so far
        self.text_position = 0
        self.complete = False
        # Since the step that completed (that step excluded, as upstream's ``A[completed_at:]``): the column
        # sums of the last 3 text columns, and the sum of each row's maximum over the columns before the last 5.
        self.tail_sums = np.zeros(min(3, self.text_len))
        self.earlier_maxima = 0.0
        self.tokens: deque[int] = deque(maxlen=8)  # the last ids fed, the start-of-speech id first

    @property
    def text_len(self) -> int:
        return self.text_end - self.text_start

    def step(self, maps: np.ndarray, last_token: int) -> AlignmentVerdict:
        """maps: (heads, rows, keys) probabilities of this step's query rows: at the first step the prefill's
        rows from ``text_end`` on (the start-of-speech rows), then each decode step's one row; keys cover at
        least the text. last_token: the last id fed to the model (the start-of-speech id at the first step).
        """
        s = self.text_len
        aligned = maps.mean(axis=0)[:, self.text_start : self.text_end].copy()  # (rows, S)
        aligned[:, self.frame + 1 :] = 0  # upstream's monotonic mask: frame f sees text columns 0 .. f
        position = int(aligned[-1].argmax())
        # A jump outside (-4, 7) is a "discontinuity": the position stays where it was.
        if -4 < position - self.text_position < 7:
            self.text_position = position
        if self.complete:
            self.tail_sums += aligned[:, -3:].sum(axis=0)
            if s > 5:
                self.earlier_maxima += float(aligned[:, :-5].max(axis=1).sum())
        self.complete = self.complete or self.text_position >= s - 3
        self.tokens.append(last_token)
        verdict = AlignmentVerdict(
            suppress_eos=position < s - 3 and s > 5,
            long_tail=self.complete
            and bool(self.tail_sums.max() >= 5),  # 5 frames = 200 ms on the last token
            alignment_repetition=self.complete and s > 5 and self.earlier_maxima > 5,
            token_repetition=len(self.tokens) >= 3 and self.tokens[-1] == self.tokens[-2],
        )
        if verdict.force_eos:
            logger.info(
                "alignment forces the stop token at frame %d: long_tail=%s alignment_repetition=%s "
                "token_repetition=%s",
                self.frame,
                verdict.long_tail,
                verdict.alignment_repetition,
                verdict.token_repetition,
            )
        self.frame += 1
        return verdict


def steer_eos(logits: mx.array, suppress: mx.array, force: mx.array, eos: int) -> mx.array:
    """Apply a verdict to (1, V) CFG-combined logits, as upstream does before the repetition penalty: the stop
    token's logit -2**15 where ``suppress``; every logit -2**15 and the stop token's +2**15 where ``force``.
    suppress, force: bool scalars (arrays, so that a compiled sampler is traced once)."""
    is_eos = mx.arange(logits.shape[-1]) == eos
    logits = mx.where(suppress & is_eos, -_LOGIT_CAP, logits)
    return mx.where(force, mx.where(is_eos, _LOGIT_CAP, -_LOGIT_CAP), logits)
