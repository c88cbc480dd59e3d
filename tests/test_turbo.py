"""Turbo and Nano end to end on tiny random checkpoints in upstream layout (no torch): conversion finds the
variant from the files, ``TTS`` speaks through Turbo's speech model and meanflow decoder, knobs Turbo does not
have are errors, and the CLI works from a Hub repo id offline."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from mlx_chatterbox import TTS, SamplingParams, convert
from mlx_chatterbox.cli import main
from mlx_chatterbox.convert import ConversionError, source_variant
from mlx_chatterbox.generation.turbo import S3GEN_SIL, SILENCE_TOKENS
from mlx_chatterbox.models.gpt2 import T3TurboConfig
from mlx_chatterbox.text import TokenizerError
from tests.conftest import TINY_MODEL, TINY_TURBO, random_voice, write_upstream_checkpoint
from tests.toy_gpt2_tokenizer import VOCAB_SIZE

TINY_NANO = dataclasses.replace(
    TINY_TURBO,
    variant="nano",
    t3=T3TurboConfig(hidden_size=48, num_layers=1, num_heads=3, text_vocab_size=VOCAB_SIZE),
)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def turbo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("turbo")
    return TTS.load(
        convert(write_upstream_checkpoint(tmp / "up", TINY_TURBO), tmp / "mlx", config=TINY_TURBO)
    )


def test_conversion_finds_the_variant_and_loads_it(tmp_path):
    for cfg, t3_file in ((TINY_TURBO, "t3_turbo_v1.safetensors"), (TINY_NANO, "t3_nano_v1.safetensors")):
        src = write_upstream_checkpoint(tmp_path / cfg.variant, cfg)
        assert (src / t3_file).is_file() and (src / "s3gen_meanflow.safetensors").is_file()
        assert source_variant(src) == cfg.variant
        dst = convert(src, tmp_path / f"{cfg.variant}-mlx", config=cfg)
        manifest = json.loads((dst / "config.json").read_text())
        assert manifest["variant"] == cfg.variant and manifest["files"]["tokenizer"] == "tokenizer"
        assert source_variant(dst) == cfg.variant
        tts = TTS.load(dst)
        assert tts.speech.variant == cfg.variant and tts.s3gen.estimator.config.meanflow
        assert tts.folder.networks == cfg


def test_conversion_errors_name_the_variant(tmp_path):
    src = write_upstream_checkpoint(tmp_path / "up", TINY_TURBO)
    with pytest.raises(ConversionError, match="holds a turbo checkpoint; the config given is for english"):
        convert(src, tmp_path / "a", config=TINY_MODEL)
    with pytest.raises(ConversionError, match="t3_cfg.safetensors not found"):
        convert(src, tmp_path / "b", variant="english")
    with pytest.raises(ConversionError, match=r"quantization is implemented for the Llama T3s \(English, Multilingual\), not turbo"):
        convert(src, tmp_path / "c", config=TINY_TURBO, quantize=4)
    write_upstream_checkpoint(src, TINY_MODEL)  # now both T3 files: which one is meant?
    with pytest.raises(ConversionError, match=r"t3_cfg.safetensors and t3_turbo_v1.safetensors.*\(pass variant= to choose\)$"):
        convert(src, tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["up"]  # nothing half-written


def test_conversion_refuses_a_tokenizer_of_another_size(tmp_path):
    # Upstream only warns when the tokenizer and T3's text table differ (then ids past the table fail later).
    t3 = dataclasses.replace(TINY_TURBO.t3, text_vocab_size=VOCAB_SIZE + 1)
    cfg = dataclasses.replace(TINY_TURBO, t3=t3)
    src = write_upstream_checkpoint(tmp_path / "up", cfg)
    with pytest.raises(
        TokenizerError,
        match=rf"{src} does not fit this model: it has {VOCAB_SIZE} tokens but the model's text vocabulary "
        rf"has {VOCAB_SIZE + 1}",
    ):
        convert(src, tmp_path / "mlx", config=cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["up"]


def test_turbo_speaks_with_its_tail_of_silence(turbo):
    voice = random_voice(1)
    tokens = turbo.speech_tokens("Hello there [laugh].", voice, seed=0, max_new_tokens=12, top_k=40)
    assert len(tokens) == 13 + SILENCE_TOKENS and tokens[-SILENCE_TOKENS:].tolist() == [S3GEN_SIL] * 3
    assert (tokens < 6561).all()
    wav = turbo.generate("Hello there.", voice, seed=3, max_new_tokens=12)
    assert wav.dtype == np.float32 and len(wav) == (13 + SILENCE_TOKENS) * 960 and np.isfinite(wav).all()
    again = turbo.generate("Hello there.", voice, seed=3, max_new_tokens=12)
    np.testing.assert_array_equal(wav, again)
    chunks = list(turbo.stream("Hello there.", voice, seed=3, max_new_tokens=30))
    assert len(chunks) > 1 and sum(len(c) for c in chunks) == (31 + SILENCE_TOKENS) * 960


def test_knobs_turbo_does_not_have_are_errors(turbo):
    voice = random_voice(1)
    for knob in ("cfg_weight", "exaggeration", "min_p"):
        with pytest.raises(TypeError, match=f"unknown knob '{knob}' for the turbo model; its knobs are"):
            turbo.generate("Hi.", voice, **{knob: 0.5})
    with pytest.raises(ValueError, match="top_k"):
        turbo.speech_tokens("Hi.", voice, top_k=-1)
    with pytest.raises(ValueError, match="Turbo takes at most 375"):
        turbo.speech_tokens("Hi.", random_voice(2, prompt_len=400), max_new_tokens=3)


def test_english_has_no_top_k(tmp_path):
    tts = TTS.load(convert(write_upstream_checkpoint(tmp_path / "up"), tmp_path / "mlx", config=TINY_MODEL))
    with pytest.raises(TypeError, match="unknown knob 'top_k' for the english model"):
        tts.speech_tokens("Hi.", random_voice(), top_k=5)


def test_cli_knobs_are_checked_for_the_model_before_it_loads(turbo, tmp_path, capsys):
    out, model = tmp_path / "a.wav", str(turbo.path)
    random_voice(1).save(tmp_path / "v.safetensors")
    args = ["say", "Hello.", "--model", model, "--voice", str(tmp_path / "v.safetensors"), "--seed", "1"]
    assert main([*args, "--cfg-weight", "0.3", "-o", str(out)]) == 1
    assert "--cfg-weight is not a knob of the turbo model" in capsys.readouterr().err
    assert main([*args, "--top-k", "50", "--max-new-tokens", "8", "-o", str(out)]) == 0
    wav, rate = sf.read(out)
    assert rate == 24000 and len(wav) == (9 + SILENCE_TOKENS) * 960
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "x"), "--variant", "nano"]) == 1


def test_cli_speaks_from_the_turbo_repo_id_offline(tmp_path):
    """``say --model ResembleAI/chatterbox-turbo`` from a Hub cache holding a random upstream-layout Turbo
    checkpoint, offline: downloaded (found in the cache), converted once, spoken. Tiny networks stand in for
    the full-size preset (in a subprocess: the Hub client reads its cache location when imported)."""
    snapshot = tmp_path / "hub" / "models--ResembleAI--chatterbox-turbo" / "snapshots" / ("ab" * 20)
    write_upstream_checkpoint(snapshot, TINY_TURBO)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("ab" * 20)
    random_voice(1).save(tmp_path / "v.safetensors")
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.conftest import TINY_TURBO
        from mlx_chatterbox import variants
        from mlx_chatterbox.cli import main
        variants.PRESETS["turbo"] = TINY_TURBO
        sys.exit(main(sys.argv[1:]))
        """)
    out = tmp_path / "out.wav"
    argv = [
        "say",
        "Hello.",
        "--model",
        "ResembleAI/chatterbox-turbo",
        "--voice",
        str(tmp_path / "v.safetensors"),
    ]
    env = dict(
        os.environ,
        HF_HUB_CACHE=str(tmp_path / "hub"),
        HF_HUB_OFFLINE="1",
        MLX_CHATTERBOX_CACHE=str(tmp_path / "converted"),
    )
    run = subprocess.run(
        [sys.executable, "-c", script, *argv, "--max-new-tokens", "6", "--seed", "0", "-o", str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    wav, rate = sf.read(out)
    assert rate == 24000 and len(wav) == (7 + SILENCE_TOKENS) * 960
    assert any((tmp_path / "converted").iterdir())  # converted once, into the cache


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_engine_serves_turbo_as_tts_does(turbo, stream):
    """The Worker drives Turbo's batch (``TurboTokenBatch``): each job gives what ``TTS.generate`` or
    ``TTS.stream`` gives it alone, chunk for chunk, the silence tail included."""
    from mlx_chatterbox.sampling import TurboParams
    from mlx_chatterbox.server.worker import SpeechJob, Worker

    jobs = [
        SpeechJob("Hello there.", random_voice(1), TurboParams(max_new_tokens=14), seed=1, stream=stream),
        SpeechJob("Short.", random_voice(2, prompt_len=60), TurboParams(max_new_tokens=9, top_k=20), seed=2,
                  watermark=False, stream=stream),
    ]  # fmt: skip
    with Worker(turbo, max_batch=2) as worker:
        tickets = [worker.submit(job) for job in jobs]
        got = [list(t) for t in tickets]
        with pytest.raises(ValueError, match="params must be a TurboParams for the turbo model"):
            worker.submit(dataclasses.replace(jobs[0], params=SamplingParams()))
    for job, chunks in zip(jobs, got):
        kwargs = dict(seed=job.seed, watermark=job.watermark)
        if stream:
            expected = list(turbo.stream(job.text, job.voice, job.params, **kwargs))
        else:
            expected = [turbo.generate(job.text, job.voice, job.params, **kwargs)]
        assert [len(c) for c in chunks] == [len(c) for c in expected]
        assert all(np.array_equal(a, b) for a, b in zip(chunks, expected))


def test_server_requests_take_the_served_models_knobs():
    from mlx_chatterbox.sampling import TurboParams
    from mlx_chatterbox.server.schema import SpeechRequest

    body = SpeechRequest(model="tts-1", input="Hi.", top_k=50, temperature=0.7)
    assert body.sampling_params(TurboParams, "turbo") == TurboParams(top_k=50, temperature=0.7)
    with pytest.raises(ValueError, match="top_k is not a knob of the english model"):
        body.sampling_params()
    with pytest.raises(ValueError, match="cfg_weight is not a knob of the turbo model"):
        SpeechRequest(model="tts-1", input="Hi.", cfg_weight=0.3).sampling_params(TurboParams, "turbo")
