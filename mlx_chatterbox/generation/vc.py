"""Voice conversion (upstream ``ChatterboxVC``): the speech of a source recording, re-synthesised by S3Gen in a
target voice.

Upstream's ``generate`` reads the source at 16 kHz (``librosa.load(audio, sr=16000)``), turns it into S3 speech
tokens with S3Gen's tokenizer in one call (``S3Tokenizer.forward``, no ``max_len``, no padding), and vocodes them
with ``S3Token2Wav.inference`` under the target's S3Gen prompt, which is exactly what a ``Voice`` holds (the first
10 s of a cloned recording, ``DEC_COND_LEN``; the built-in voice is ``conds.pt``'s ``gen``, as upstream's
``ref_dict``). Then the watermark.

Long sources: the tokenizer's encoder takes 30 s; past that, s3tokenizer 0.3.0's ``quantize`` cuts the mel into
30 s windows 26 s apart and keeps each overlap's halves (``_quantize_mixed_batch``, ``merge_tokenized_segments``),
ported here, so the tokens equal upstream's, except for lengths where upstream loses up to 2 s near the end
(``source_tokens``). S3Gen runs once over all of them, as upstream, up to ``PASS_TOKENS`` (40 s); a longer
source is vocoded in overlapping pieces (our choice: the flow encoder's and the CFM's attention memory grows with
the square of the length), joined by a 40 ms crossfade in the middle of each overlap.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..audio.mel import s3tokenizer_log_mel
from ..models.s3tokenizer import S3Tokenizer
from .vocode import SAMPLES_PER_TOKEN, crossfade_join

WINDOW_FRAMES = 3000  # model_v2.py quantize: 30 s of 100 Hz frames, the most one encoder pass takes
STRIDE_FRAMES = 2600  # windows of 30 s starting every 26 s: 4 s of overlap
EDGE_TOKENS = 50  # (4 s // 2) * 25 Hz: each window gives up this many tokens at an edge it shares
# One S3Gen pass as upstream up to 40 s of source, the longest that T3 ever hands S3Gen (1000 tokens).
PASS_TOKENS = 1000
OVERLAP_TOKENS = 50  # what consecutive pieces both decode (2 s): the seam has 1 s of context on each side
SEAM_SAMPLES = 960  # the crossfade at a seam (40 ms), as between the pieces of a long text


def check_decoder(variant: str, meanflow: bool) -> None:
    """Voice conversion is upstream's ``ChatterboxVC``: English's S3Gen (the multilingual models share it).
    Turbo's and Nano's meanflow S3Gen has no voice conversion upstream, so there is nothing to match: refused.
    """
    if meanflow:
        raise ValueError(
            f"voice conversion runs English's S3Gen, as upstream ChatterboxVC; the {variant} model's meanflow "
            "decoder has no voice conversion upstream: use ResembleAI/chatterbox (english or multilingual)"
        )


def source_tokens(tokenizer: S3Tokenizer, wav_16k: np.ndarray) -> np.ndarray:
    """(L,) float32 samples at 16 kHz -> (N,) int32 S3 speech tokens, 25 per second, as upstream's tokenizer
    gives them for the whole source (L // 640 tokens, rounded up)."""
    mel = s3tokenizer_log_mel(wav_16k)  # (T, 128); the floor's maximum is the whole source's, as upstream
    frames = mel.shape[0]
    if frames <= WINDOW_FRAMES:
        return _encode(tokenizer, mel)
    # Upstream starts a window every 26 s while frames remain (``while start < mel_len``), even after one
    # has reached the end: that extra window gives back fewer than the 50 tokens its predecessor gave up, so
    # up to 2 s of speech went missing near the end. We stop at the window that reaches the end; other
    # lengths are as upstream.
    starts = [0]
    while starts[-1] + WINDOW_FRAMES < frames:
        starts.append(starts[-1] + STRIDE_FRAMES)
    # One window per call (upstream batches them, zero-padded and masked: the same codes, more memory).
    codes = [_encode(tokenizer, mel[start : start + WINDOW_FRAMES]) for start in starts]
    last = len(codes) - 1
    # Python slicing as upstream's: a window shorter than an edge keeps nothing.
    kept = [
        c[(EDGE_TOKENS if i else 0) : (len(c) if i == last else -EDGE_TOKENS)] for i, c in enumerate(codes)
    ]
    return np.concatenate(kept)


def _encode(tokenizer: S3Tokenizer, mel: np.ndarray) -> np.ndarray:
    codes, _ = tokenizer(mx.array(mel)[None], mx.array([mel.shape[0]], dtype=mx.int32))
    return np.array(codes[0], dtype=np.int32)


def pieces(n: int) -> list[tuple[int, int]]:
    """Token spans [start, stop) that S3Gen vocodes for ``n`` source tokens: one pass up to ``PASS_TOKENS``,
    else pieces of at most that many, of about equal length, consecutive ones sharing ``OVERLAP_TOKENS``."""
    if n <= PASS_TOKENS:
        return [(0, n)]
    count = math.ceil((n - OVERLAP_TOKENS) / (PASS_TOKENS - OVERLAP_TOKENS))
    starts = [round(i * (n - OVERLAP_TOKENS) / count) for i in range(count)]
    stops = [start + OVERLAP_TOKENS for start in starts[1:]] + [n]
    return list(zip(starts, stops))


def join(wavs: list[np.ndarray], spans: list[tuple[int, int]]) -> np.ndarray:
    """The pieces' waveforms (``wavs[i]`` vocodes ``spans[i]``) as one: each seam in the middle of an overlap,
    crossfaded over ``SEAM_SAMPLES``."""
    if len(wavs) == 1:
        return wavs[0]
    seams = [start + OVERLAP_TOKENS // 2 for start, _ in spans[1:]]  # tokens
    kept = []
    for i, (wav, (start, stop)) in enumerate(zip(wavs, spans)):
        # 480 when the voice's prompt mel has an odd length: S3Gen's output then starts half a token late.
        late = SAMPLES_PER_TOKEN * (stop - start) - len(wav)
        lo = 0 if i == 0 else SAMPLES_PER_TOKEN * (seams[i - 1] - start) - SEAM_SAMPLES // 2 - late
        hi = (
            len(wav)
            if i == len(wavs) - 1
            else SAMPLES_PER_TOKEN * (seams[i] - start) + SEAM_SAMPLES // 2 - late
        )
        kept.append(wav[lo:hi])
    return crossfade_join(kept, SEAM_SAMPLES)
