"""Float32 mono samples -> the bytes of OpenAI's response formats, as a whole file or chunk by chunk.

wav and pcm are written here (16-bit little-endian); flac, mp3 and opus go through the libsndfile that the
soundfile wheel bundles (no system ffmpeg); aac needs PyAV (``pip install mlx-chatterbox[aac]``).

Streaming: a ``StreamEncoder`` returns the bytes each chunk adds. A streamed wav has 0xFFFFFFFF as its sizes (the
convention for a wav of unknown length). libsndfile rewrites a file's header when it closes (FLAC's total sample
count and checksum, MP3's LAME tag), which a stream cannot do once the header has been sent: a streamed flac says
"length unknown" (valid FLAC; ffmpeg and browsers play it), and a streamed mp3 has no gapless tag, so decoders add
the encoder's delay and padding (about 1-2 frames of 1152 samples) to its length. Opus streams exactly.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile as sf

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
_SOUNDFILE = {  # response_format -> soundfile format, subtype, extra SoundFile arguments
    "flac": ("FLAC", "PCM_16", {}),
    # libsndfile's default MP3 rate is ~12 kb/s; a constant ~80 kb/s (perf-serving.md §3.3) is clear speech.
    "mp3": ("MP3", "MPEG_LAYER_III", {"bitrate_mode": "CONSTANT", "compression_level": 0.5}),
    "opus": ("OGG", "OPUS", {}),
}
_UNKNOWN_SIZE = 0xFFFFFFFF
AAC_HINT = "response_format 'aac' needs PyAV: pip install 'mlx-chatterbox[aac]' (or choose mp3, opus or flac)"


def content_type(fmt: str, sample_rate: int) -> str:
    """The Content-Type of a response in ``fmt`` (pcm says its rate and channels, as OpenRouter's does)."""
    return {
        "mp3": "audio/mpeg",
        "opus": "audio/ogg; codecs=opus",
        "aac": "audio/aac",
        "flac": "audio/flac",
        "wav": "audio/wav",
        "pcm": f"audio/pcm;rate={sample_rate};channels=1",
    }[fmt]


def check_format(fmt: str) -> None:
    """Raise ValueError (naming the fix) for a format that cannot be written here."""
    if fmt not in FORMATS:
        raise ValueError(f"response_format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "aac":
        try:
            import av  # noqa: F401
        except ImportError:
            raise ValueError(AAC_HINT) from None


def pcm16(samples: np.ndarray) -> bytes:
    """Float samples -> 16-bit signed little-endian PCM: x * 32768 rounded, clipped to [-32768, 32767] (as
    libsndfile converts, so that every format here quantizes alike and int / 32768 reads it back)."""
    x = np.round(np.asarray(samples, dtype=np.float32) * 32768.0)
    return np.clip(x, -32768, 32767).astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte header of a mono 16-bit PCM wav; ``data_bytes`` None writes the unknown-size convention."""
    data = _UNKNOWN_SIZE if data_bytes is None else data_bytes
    riff = _UNKNOWN_SIZE if data_bytes is None else 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, 2 * sample_rate, 2, 16)
        + b"data"
        + struct.pack("<I", data)
    )


def encode(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """The whole file of (T,) float32 mono ``samples`` in ``fmt`` (with its final header)."""
    check_format(fmt)
    samples = np.asarray(samples, dtype=np.float32)
    if fmt == "pcm":
        return pcm16(samples)
    if fmt == "wav":
        data = pcm16(samples)
        return wav_header(sample_rate, len(data)) + data
    if fmt == "aac":
        enc = StreamEncoder(fmt, sample_rate)
        return enc.write(samples) + enc.close()
    buf = io.BytesIO()
    major, subtype, extra = _SOUNDFILE[fmt]
    with sf.SoundFile(buf, "w", sample_rate, 1, subtype, format=major, **extra) as f:
        f.write(samples)
    return buf.getvalue()


class _GrowingFile(io.RawIOBase):
    """A seekable in-memory file for libsndfile whose new bytes past ``sent`` can be taken as they appear."""

    def __init__(self):
        self.data = bytearray()
        self.pos = 0
        self.sent = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:
        b = bytes(b)
        end = self.pos + len(b)
        if end > len(self.data):
            self.data.extend(bytes(end - len(self.data)))
        self.data[self.pos : end] = b
        self.pos = end
        return len(b)

    def read(self, size: int = -1) -> bytes:
        end = len(self.data) if size is None or size < 0 else min(len(self.data), self.pos + size)
        out = bytes(self.data[self.pos : end])
        self.pos = max(self.pos, end)
        return out

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.data)}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def take(self) -> bytes:
        """The bytes written past what was taken before (rewrites of taken bytes are lost: see the module)."""
        out = bytes(self.data[self.sent :])
        self.sent = len(self.data)
        return out


class _Sink:
    """A write-only, non-seekable file for PyAV, so that its muxer writes a stream (no header rewrite)."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, b) -> int:
        self.parts.append(bytes(b))
        return len(b)

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


class StreamEncoder:
    """Encodes a stream of float32 mono chunks: ``write(chunk)`` returns the bytes it adds (possibly none),
    ``close()`` the rest. Concatenated, they are one file in ``fmt`` (module docstring: what a stream lacks).
    """

    def __init__(self, fmt: str, sample_rate: int):
        check_format(fmt)
        self.fmt, self.sample_rate = fmt, sample_rate
        self._header = fmt == "wav"
        self._file = None
        if fmt in _SOUNDFILE:
            major, subtype, extra = _SOUNDFILE[fmt]
            self._file = _GrowingFile()
            self._sf = sf.SoundFile(self._file, "w", sample_rate, 1, subtype, format=major, **extra)
        elif fmt == "aac":
            import av

            self._file = _Sink()
            self._av = av.open(self._file, "w", format="adts")
            self._stream = self._av.add_stream("aac", rate=sample_rate, layout="mono")
            self._pending = np.zeros(0, np.float32)

    def write(self, samples: np.ndarray) -> bytes:
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self.fmt in ("pcm", "wav"):
            head = wav_header(self.sample_rate, None) if self._header else b""
            self._header = False
            return head + pcm16(samples)
        if self.fmt == "aac":
            return self._aac(samples, final=False)
        self._sf.write(samples)
        return self._file.take()

    def close(self) -> bytes:
        if self.fmt in ("pcm", "wav"):
            return self.write(np.zeros(0, np.float32)) if self._header else b""
        if self.fmt == "aac":
            return self._aac(np.zeros(0, np.float32), final=True)
        self._sf.close()
        return self._file.take()

    def _aac(self, samples: np.ndarray, final: bool) -> bytes:
        import av

        ctx = self._stream.codec_context
        if not ctx.is_open:
            ctx.open()
        size = ctx.frame_size or 1024  # the AAC encoder takes whole frames of 1024 samples
        self._pending = np.concatenate([self._pending, samples])
        whole = len(self._pending) if final else len(self._pending) // size * size
        for i in range(0, whole, size):
            block = np.ascontiguousarray(self._pending[None, i : i + size])
            frame = av.AudioFrame.from_ndarray(block, format="fltp", layout="mono")
            frame.sample_rate = self.sample_rate
            for packet in self._stream.encode(frame):
                self._av.mux(packet)
        self._pending = self._pending[whole:]
        if final:
            for packet in self._stream.encode(None):
                self._av.mux(packet)
            self._av.close()
        return self._file.take()
