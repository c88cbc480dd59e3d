"""The Perth implicit watermark that upstream puts on every output, and its detector, without torch.

Mirrors resemble-perth 1.0.1's ``PerthImplicitWatermarker`` (``perth_net/perth_net_implicit/perth_watermarker.py``,
``audio_processor.py``, ``utils.py``; architecture §7), with its trained weights (MIT licence, see NOTICE):

apply:  wav --soxr_hq--> 32 kHz --STFT--> |S| in dB, normalised (dB + 180) / 195, and the phase --embedder--> dB
        --iSTFT (same phase)--> 32 kHz --soxr_hq--> wav.
detect: wav --polyphase (scipy resample_poly)--> 32 kHz --STFT--> normalised dB --detector--> confidence.

perth turns the confidence into its answer with ``round(clip(confidence, 0, 1))``: 1.0 means watermarked, i.e.
a confidence above 0.5 (0.5 itself rounds to even, 0). ``detect`` returns the clipped confidence (perth's
``get_watermark(..., round=False)``) and ``is_watermarked`` that decision.
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..audio.resample import resample_polyphase, resample_soxr_hq
from ..audio.spectral import as_waveform, hann_window, istft, stft
from ..models import layers
from ..models.hift import overlap_add
from ..models.perth import PerthConfig, PerthNet

# The converted perth weights (scripts/convert_perth.py writes them here).
ASSET = Path(__file__).resolve().parents[1] / "assets" / "perth_implicit.safetensors"
FORMAT = "mlx-chatterbox-perth"

# Where ``apply`` finds its spectra. On the host: numpy (float64 FFTs, 23 ms of host work for 10 s of audio on
# our 2-core CPU), the network's input and output copied to and from the device (4 MB each for 10 s). On the
# device: MLX, float32 as perth's torch code (only the 32 kHz samples cross, 1.3 MB each way). None (the
# default): on the device where MLX runs on CUDA, on the host elsewhere. On an H200 the watermark of a 10 s
# text -> wav took 11-15 ms on the device against 42-50 on the host (run AL); on our CPU 167 ms against 58 (MLX's
# CPU backend is slow at complex arithmetic and transcendentals); not measured on Metal. True / False: the
# device / the host everywhere.
SPECTRA_ON_DEVICE: bool | None = None

# The device's FFTs take the frames FFT_ROWS at a time, the last block zero-padded, so that they always have
# one shape. MLX-CUDA (0.32.4, fft.cu) keeps one cuFFT plan per transform size and row count, 128 of them, in
# a cache that the whole process shares, and raises "Cache thrashing is happening" once it has made 256 plans
# in the process's life (unless MLX_ENABLE_CACHE_THRASHING_CHECK=0, which _backend.py sets; then it plans
# again): with a plan per chunk length, a server that marks streamed chunks of every length gets there after
# ~128 lengths. (Run AM: a server answered one request 500 and cut two streams off after ~170 marked chunks,
# its worker having failed nothing; its log was not kept, and this is the likeliest cause.) 256 frames are
# 2.56 s at 32 kHz; a shorter chunk's padding costs the GPU microseconds.
FFT_ROWS = 256
# That cache and its plans (their stream and work area set before each run) are shared by all threads without
# a lock, so one thread at a time runs the device's marking (the server marks on several threads).
_DEVICE_MARKING = threading.Lock()


def spectra_on_device() -> bool:
    """Whether ``Watermarker.apply`` finds its spectra on the device (``SPECTRA_ON_DEVICE``)."""
    if SPECTRA_ON_DEVICE is not None:
        return SPECTRA_ON_DEVICE
    return mx.default_device() == mx.gpu and layers._CUDA


def _in_blocks(fft: Callable[[mx.array], mx.array], frames: mx.array) -> mx.array:
    """``fft`` of (T, k) frames row by row, run on blocks of ``FFT_ROWS`` rows (the last one zero-padded)."""
    rows = frames.shape[0]
    frames = mx.pad(frames, [(0, -rows % FFT_ROWS), (0, 0)])
    blocks = [fft(frames[i : i + FFT_ROWS]) for i in range(0, frames.shape[0], FFT_ROWS)]
    return mx.concatenate(blocks)[:rows]


class Watermarker:
    """Perth implicit watermarker: ``apply`` marks a waveform, ``detect`` / ``is_watermarked`` read a mark back.

    Build it with ``Watermarker.load()`` (the converted trained weights) or ``Watermarker(net)`` around any
    ``PerthNet`` (tests use tiny random ones). Any sample rate works: audio is resampled to the network's rate
    (32 kHz) and back, as perth does.
    """

    def __init__(self, net: PerthNet):
        self.net = net
        self.config: PerthConfig = net.config

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> Watermarker:
        """The watermarker with converted weights from ``path`` (default: the package's
        ``assets/perth_implicit.safetensors``), loaded strictly; the network config comes from the file."""
        path = Path(path).expanduser() if path is not None else ASSET
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found; convert resemble-perth's weights with "
                f'"python scripts/convert_perth.py --out {path}" (needs resemble-perth installed, not torch)'
            )
        weights, metadata = mx.load(str(path), return_metadata=True)
        if metadata.get("format") != FORMAT or "config" not in metadata:
            raise ValueError(f"{path} is not a converted Perth watermark file (format {FORMAT!r} expected)")
        net = PerthNet(PerthConfig(**json.loads(metadata["config"])))
        # Stored weights may be narrower (float16); the network runs in float32 as perth does.
        net.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()], strict=True)
        net.eval()
        mx.eval([a for _, a in tree_flatten(net)])  # its tables too: a server uses it on another thread
        return cls(net)

    @staticmethod
    def metadata(cfg: PerthConfig, **extra: str) -> dict[str, str]:
        """The safetensors metadata ``load`` expects: the format tag and the config as JSON, plus ``extra``."""
        return {"format": FORMAT, "config": json.dumps(asdict(cfg)), **extra}

    def apply(self, wav: np.ndarray, sample_rate: int) -> np.ndarray:
        """Watermark a mono waveform, as perth's ``apply_watermark(wav, sample_rate)``.

        Args:
            wav: (L,) float samples in [-1, 1] (rounded to float32, as upstream hands perth float32).
            sample_rate: Hz.
        Returns:
            float32 samples at ``sample_rate``. Like perth, the length is not kept exactly: the iSTFT returns
            hop·(N // hop) samples of the N at 32 kHz, resampled back with librosa's ceil rule, so up to one 10 ms
            hop goes from the end (at 24 kHz: 240·(N // 320) samples, N = ceil(L·4/3)); at 44.1 kHz the ceil can
            even add one. A clip too short for perth's STFT (at most n_fft // 2 samples at 32 kHz, 32 ms; perth
            raises) is returned unchanged.
        """
        wav = self._check(wav, sample_rate)
        cfg = self.config
        rate_changes = sample_rate != cfg.sample_rate
        x = resample_soxr_hq(wav, sample_rate, cfg.sample_rate) if rate_changes else wav
        if x.shape[0] <= cfg.n_fft // 2:
            return wav.copy()
        if spectra_on_device():
            y = self._mark_on_device(x)
        else:
            magspec, phasor = self.magphase(x)
            marked, _mask = self.net.encoder(mx.array(magspec)[None])
            y = self.signal(np.array(marked[0]), phasor)
        return resample_soxr_hq(y, cfg.sample_rate, sample_rate) if rate_changes else y

    def confidence(self, wav: np.ndarray, sample_rate: int) -> float:
        """The detector's raw output, before perth clips and rounds it: about 1 when marked, 0 when not.

        Args:
            wav: (L,) float samples in [-1, 1] (rounded to float32).
            sample_rate: Hz.
        Returns:
            a float, NaN where perth gives NaN (digital silence: no frame passes the gate) or fails (a clip of at
            most n_fft // 2 samples at 32 kHz, 32 ms, which perth's reflect padding cannot take).
        """
        wav = self._check(wav, sample_rate)
        cfg = self.config
        # perth's get_watermark resamples with res_type="polyphase", not the soxr_hq of apply_watermark.
        x = resample_polyphase(wav, sample_rate, cfg.sample_rate) if sample_rate != cfg.sample_rate else wav
        if x.shape[0] <= cfg.n_fft // 2:
            return math.nan
        magspec = self.magspec(x)
        return float(self.net.decoder(mx.array(magspec)[None])[0].item())

    def detect(self, wav: np.ndarray, sample_rate: int) -> float:
        """Watermark confidence clipped to [0, 1], perth's ``get_watermark(wav, sample_rate, round=False)``.

        Args:
            wav: (L,) float samples in [-1, 1] (rounded to float32).
            sample_rate: Hz.
        Returns:
            about 1.0 for marked audio, about 0.0 for unmarked; 0.0 where ``confidence`` is NaN (perth: NaN or an
            error).
        """
        c = self.confidence(wav, sample_rate)
        return 0.0 if math.isnan(c) else min(max(c, 0.0), 1.0)

    def is_watermarked(self, wav: np.ndarray, sample_rate: int) -> bool:
        """perth's decision, ``get_watermark(wav, sample_rate) == 1.0``: the rounded clipped confidence is 1."""
        return bool(np.round(self.detect(wav, sample_rate)) == 1.0)

    def magphase(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """perth ``AudioProcessor.signal_to_magphase`` (torchaudio Spectrogram: centered, reflect-padded,
        periodic Hann, power None) then ``cx_to_magphase``: (L,) samples at 32 kHz -> (normalised dB
        (T, n_freq) float32, unit phasor exp(i·phase) (T, n_freq) complex64), T = 1 + L // hop.

        The phasor is spec / |spec|, not perth's angle: ``signal`` needs only exp(i·angle), and arctan2 then
        cos/sin cost more than the FFT. Where |spec| is 0 or subnormal it is exp(i·angle(spec)): angle(±0 ± 0j)
        is 0, ±pi or -0 as perth's, and 1 / |spec| would overflow (NaN audio from near-silent frames)."""
        spec, magnitude = self._spectrum(x)
        tiny = magnitude < np.finfo(np.float32).tiny
        at_tiny = np.exp(1j * np.angle(spec[tiny])).astype(np.complex64) if tiny.any() else None
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # tiny bins, replaced below
            spec *= np.reciprocal(magnitude)  # a real factor: far cheaper than complex division
        if at_tiny is not None:
            spec[tiny] = at_tiny
        return self._normalised_db(magnitude), spec

    def magspec(self, x: np.ndarray) -> np.ndarray:
        """``magphase``'s normalised dB alone, (T, n_freq) float32, for the detector."""
        return self._normalised_db(self._spectrum(x)[1])

    def signal(self, magspec: np.ndarray, phasor: np.ndarray) -> np.ndarray:
        """perth ``magphase_to_cx`` then ``AudioProcessor.magphase_to_signal`` (torch.istft, centered, no
        length): (T, n_freq) normalised dB and unit phasor (as ``magphase`` returns it) -> (hop·(T - 1),)
        float32 samples at 32 kHz. All in float32, as perth's torch code: ~7e-7 relative from perth's own
        reconstruction of the same input (float64 arithmetic: ~2.4e-7, for ~35% more time)."""
        phasor = np.asarray(phasor)
        if not np.iscomplexobj(phasor):
            raise TypeError(
                f"phasor must be complex, exp(i·phase) as magphase returns it, got dtype {phasor.dtype}; "
                "for a phase in radians pass np.exp(1j * phase)"
            )
        if phasor.shape != np.shape(magspec):
            raise ValueError(f"magspec {np.shape(magspec)} and phasor {phasor.shape} must have one shape")
        cfg = self.config
        min_db = self._min_db()
        # 10 ** (dB / 20) as the cheaper exp(dB · ln 10 / 20); utils.magphase_to_cx caps dB / 20 at 10.
        ln10 = math.log(10.0)
        exponent = magspec.astype(np.float32)
        exponent *= (-min_db + cfg.headroom_db) * ln10 / 20.0
        exponent += min_db * ln10 / 20.0
        magnitude = np.exp(np.minimum(exponent, 10.0 * ln10, out=exponent), out=exponent)
        spec = phasor.astype(np.complex64, copy=False) * magnitude
        n_fft, hop, win = cfg.n_fft, cfg.hop_size, cfg.window_size
        return istft(spec, n_fft, hop, win, center=True, dtype=np.float32, precision=np.float32)

    @functools.cached_property
    def _device_window(self) -> mx.array:
        """The periodic Hann window of ``window_size`` zero-padded to ``n_fft`` (centered), float32, made once:
        ``apply`` runs for every streamed chunk."""
        cfg = self.config
        left = (cfg.n_fft - cfg.window_size) // 2
        window = np.zeros(cfg.n_fft, np.float32)
        window[left : left + cfg.window_size] = hann_window(cfg.window_size)
        return mx.array(window)

    def _mark_on_device(self, x: np.ndarray) -> np.ndarray:
        """``magphase``, the embedder and ``signal`` of (L,) float32 samples at 32 kHz, in MLX on the default
        device and in float32 (perth's torch precision): the same steps in the same order, FFTs included."""
        cfg = self.config
        n, hop, pad = cfg.n_fft, cfg.hop_size, cfg.n_fft // 2
        window = self._device_window
        s = mx.array(x, mx.float32)  # float64 has no GPU kernels
        s = mx.concatenate([s[pad:0:-1], s, s[-2 : -pad - 2 : -1]])  # centered: stft's reflect padding
        frames = 1 + x.shape[0] // hop
        spec = _in_blocks(mx.fft.rfft, mx.as_strided(s, (frames, n), (hop, 1)) * window)
        magnitude = mx.abs(spec)
        min_db = self._min_db()
        db = (mx.log10(mx.maximum(magnitude, cfg.stft_magnitude_min)) * 20.0 - min_db) / (
            cfg.headroom_db - min_db
        )
        marked, _mask = self.net.encoder(db[None])
        # magphase's phasor, exp(i·angle(spec)) where |spec| is 0 or subnormal; then signal's magnitudes.
        angle = mx.arctan2(mx.imag(spec), mx.real(spec))
        tiny = magnitude < np.finfo(np.float32).tiny
        phasor = mx.where(tiny, mx.cos(angle) + 1j * mx.sin(angle), spec * mx.reciprocal(magnitude))
        ln10 = math.log(10.0)
        exponent = marked[0] * ((-min_db + cfg.headroom_db) * ln10 / 20.0) + min_db * ln10 / 20.0
        spec = phasor * mx.exp(mx.minimum(exponent, 10.0 * ln10))
        # istft: frames overlap-added in blocks of hop (padded to a whole number of them), divided by the
        # overlap-added squared window, n_fft // 2 trimmed at each end.
        blocks = [(0, 0), (0, 0), (0, -n % hop)]
        y = _in_blocks(functools.partial(mx.fft.irfft, n=n), spec) * window
        y = overlap_add(mx.pad(y[None], blocks), hop)[0]
        squares = mx.broadcast_to(mx.pad(mx.square(window), blocks[2]), (1, frames, n + blocks[2][1]))
        envelope = overlap_add(squares, hop)[0, pad : pad + hop * (frames - 1)]
        y = y[pad : pad + hop * (frames - 1)] / envelope
        below = envelope.min() < 1e-11
        with _DEVICE_MARKING:
            mx.eval(y, below)
        if below.item():
            raise ValueError(
                "the window overlap-add falls below 1e-11 inside the output (torch.istft's NOLA)"
            )
        return np.array(y)

    def _spectrum(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The STFT (T, n_freq), computed in float64 (numpy's float64 FFT is the faster one on x86) and
        rounded to complex64, and its float32 magnitude; the dB follow in float32, as perth's do."""
        cfg = self.config
        spec = stft(x, cfg.n_fft, cfg.hop_size, cfg.window_size, center=True, dtype=np.complex64)
        return spec, np.abs(spec)

    def _normalised_db(self, magnitude: np.ndarray) -> np.ndarray:
        """utils.normalize(20·log10(max(|S|, floor))): (dB - min_db) / (headroom - min_db), float32."""
        cfg = self.config
        min_db = self._min_db()
        db = np.maximum(magnitude, np.float32(cfg.stft_magnitude_min))
        np.log10(db, out=db)
        # perth's order of operations: the floor maps to exactly 0, or silent frames pass the encoder's gate.
        db *= 20.0
        db -= min_db
        db /= -min_db + cfg.headroom_db
        return db

    def _min_db(self) -> float:
        return 20.0 * math.log10(self.config.stft_magnitude_min)  # utils.normalize's min_level_db, -180

    @staticmethod
    def _check(wav: np.ndarray, sample_rate: int) -> np.ndarray:
        if int(sample_rate) != sample_rate or sample_rate <= 0:
            raise ValueError(f"sample_rate must be a positive integer rate in Hz, got {sample_rate!r}")
        x = as_waveform(wav, ndims=(1,)).astype(np.float32)
        if not np.isfinite(x).all():
            raise ValueError("wav holds NaN or inf samples")
        return x
