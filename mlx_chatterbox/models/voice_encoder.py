"""Voice encoder: Chatterbox's LSTM speaker embedding (40-bin linear power mel -> a 256-d unit vector for T3).

Mirrors upstream ``chatterbox/models/voice_encoder/voice_encoder.py`` (0.1.7) on the path that ``tts.py`` takes
(``embeds_from_wavs([wav], sample_rate=16000)``: rate 1.3, min_coverage 0.8, one utterance), from the mel on;
architecture notes §1.3, §5 and §9.16. The wav -> mel front-end and the silence trim live in ``audio/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class VoiceEncoderConfig:
    """Sizes and partial-window settings; the defaults are upstream's (``VoiceEncConfig`` and the arguments
    with which ``embeds_from_wavs`` reaches ``inference``)."""

    n_mels: int = 40
    hidden_size: int = 256
    num_layers: int = 3
    embedding_size: int = 256
    partial_frames: int = 160  # frames per partial window (1.6 s at a 160-sample hop)
    sample_rate: int = 16000
    rate: float = 1.3  # partial windows per second ("Resemble's default" in embeds_from_wavs)
    min_coverage: float = 0.8  # fraction of a last window that real frames must fill for it to be kept
    final_relu: bool = True

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if not 0 < self.min_coverage <= 1:
            raise ValueError(f"min_coverage must be in (0, 1], got {self.min_coverage}")
        if not 0 < self.frame_step <= self.partial_frames:
            raise ValueError(
                f"rate {self.rate} gives a window step of {self.frame_step} frames; it must be in "
                f"[1, partial_frames = {self.partial_frames}]"
            )

    @property
    def frame_step(self) -> int:
        """Frames between the starts of two partial windows (77 with the defaults).

        Upstream ``get_frame_step`` divides samples per window by ``ve_partial_frames``, not by the hop; the two
        are both 160, so this is the intended samples-per-hop conversion, but it is kept literally.
        """
        # Python's round and np.round both round half to even.
        return int(round((self.sample_rate / self.rate) / self.partial_frames))


def num_partials(n_frames: int, cfg: VoiceEncoderConfig) -> tuple[int, int]:
    """(number of partial windows, frames they span) for a mel of ``n_frames`` frames, as upstream
    ``get_num_wins``: a trailing window is kept only if real frames cover ``min_coverage`` of it; a mel shorter
    than one window still gives one (zero-padded) window."""
    if n_frames <= 0:
        raise ValueError(f"the mel must have at least one frame, got {n_frames}")
    win, step = cfg.partial_frames, cfg.frame_step
    n, remainder = divmod(max(n_frames - win + step, 0), step)
    # Same float expression as upstream, so the coverage edge (e.g. 128/160 >= 0.8) decides identically.
    if n == 0 or (remainder + (win - step)) / win >= cfg.min_coverage:
        n += 1
    return n, win + step * (n - 1)


class LSTMLayer(nn.Module):
    """One PyTorch-convention LSTM layer: gates [i, f, g, o], bias b_ih + b_hh, zero initial state."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.weight_ih = mx.zeros((4 * hidden_size, input_size))
        self.weight_hh = mx.zeros((4 * hidden_size, hidden_size))
        self.bias_ih = mx.zeros((4 * hidden_size,))
        self.bias_hh = mx.zeros((4 * hidden_size,))

    def __call__(self, x: mx.array) -> mx.array:
        """Hidden states (B, T, H) of inputs (B, T, C), from h_0 = c_0 = 0."""
        b, t, _ = x.shape
        h_size = self.weight_hh.shape[1]
        # The input projection of every step at once; the loop only adds the recurrent term.
        x_gates = mx.addmm(self.bias_ih + self.bias_hh, x, self.weight_ih.T)  # (B, T, 4H)
        w_hh = self.weight_hh.T
        h = mx.zeros((b, h_size), x.dtype)
        c = h
        outputs = []
        # mx.compile of the cell measured no faster on CPU and recompiles for every window count.
        for step in range(t):
            i, f, g, o = mx.split(mx.addmm(x_gates[:, step], h, w_hh), 4, axis=-1)
            c = mx.sigmoid(f) * c + mx.sigmoid(i) * mx.tanh(g)
            h = mx.sigmoid(o) * mx.tanh(c)
            outputs.append(h)
        return mx.stack(outputs, axis=1)


class VoiceEncoder(nn.Module):
    """3-layer LSTM over 160-frame partial windows -> Linear -> ReLU -> L2 norm, averaged over the windows."""

    def __init__(self, cfg: VoiceEncoderConfig = VoiceEncoderConfig()):
        super().__init__()
        self.config = cfg
        sizes = [cfg.n_mels] + [cfg.hidden_size] * (cfg.num_layers - 1)
        self.lstm = [LSTMLayer(n, cfg.hidden_size) for n in sizes]
        self.proj = nn.Linear(cfg.hidden_size, cfg.embedding_size)

    def partials(self, mel: mx.array) -> mx.array:
        """Partial windows (P, partial_frames, n_mels) of a mel (T, n_mels), exactly upstream's: window i holds
        frames [i·step, i·step + partial_frames), the mel zero-padded at the end where the windows run past it
        and frames past the last window ignored. A mel shorter than one window gives one padded window."""
        if mel.ndim != 2 or mel.shape[1] != self.config.n_mels:
            raise ValueError(f"expected a mel (T, {self.config.n_mels}), got shape {tuple(mel.shape)}")
        cfg = self.config
        n, target = num_partials(mel.shape[0], cfg)
        if target > mel.shape[0]:
            mel = mx.concatenate([mel, mx.zeros((target - mel.shape[0], cfg.n_mels), mel.dtype)])
        starts = mx.arange(n) * cfg.frame_step
        index = starts[:, None] + mx.arange(cfg.partial_frames)[None, :]  # (P, F)
        return mel[index]

    def hidden(self, partials: mx.array) -> mx.array:
        """The last LSTM layer's final hidden state (P, hidden_size) for windows (P, F, n_mels)."""
        x = partials
        for layer in self.lstm:
            x = layer(x)
        return x[:, -1]

    def embed_partials(self, partials: mx.array) -> mx.array:
        """Unit-norm embeddings (P, embedding_size) of windows (P, F, n_mels) (upstream ``forward``)."""
        x = self.proj(self.hidden(partials))
        if self.config.final_relu:
            x = nn.relu(x)
        # No epsilon, as upstream: an all-zero ReLU output gives NaN there too.
        return x / mx.linalg.norm(x, axis=-1, keepdims=True)

    def __call__(self, mel: mx.array) -> mx.array:
        """Utterance embedding (embedding_size,), unit L2 norm, of a linear power mel (T, n_mels) at 100 frames/s
        (upstream ``melspectrogram(wav).T`` of the trimmed 16 kHz wav). This is one row of upstream's
        ``embeds_from_mels([mel], rate=1.3)``: the L2-normalised mean of the partial embeddings."""
        embeds = self.embed_partials(self.partials(mel))
        mean = mx.mean(embeds, axis=0)
        return mean / mx.linalg.norm(mean)

    @staticmethod
    def checkpoint_table(cfg: VoiceEncoderConfig) -> dict[str, tuple]:
        """Upstream ``ve.safetensors`` key (no prefix) -> (our key or None, upstream shape)."""
        g, h, e = 4 * cfg.hidden_size, cfg.hidden_size, cfg.embedding_size
        table: dict[str, tuple] = {
            # The GE2E training loss's cosine-similarity scale and offset; inference never reads them.
            "similarity_weight": (None, (1,)),
            "similarity_bias": (None, (1,)),
            "proj.weight": ("proj.weight", (e, h)),
            "proj.bias": ("proj.bias", (e,)),
        }
        for k in range(cfg.num_layers):
            n_in = cfg.n_mels if k == 0 else h
            table[f"lstm.weight_ih_l{k}"] = (f"lstm.{k}.weight_ih", (g, n_in))
            table[f"lstm.weight_hh_l{k}"] = (f"lstm.{k}.weight_hh", (g, h))
            table[f"lstm.bias_ih_l{k}"] = (f"lstm.{k}.bias_ih", (g,))
            table[f"lstm.bias_hh_l{k}"] = (f"lstm.{k}.bias_hh", (g,))
        return table
