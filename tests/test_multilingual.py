"""Chatterbox Multilingual (v2 and v3) as a product, on tiny random upstream-layout checkpoints: conversion of the
torch-pickled ``s3gen.pt``/``ve.pt``, ``language=`` through the API, the engine, the server and the CLI, v3's
audio trim, and the errors. (Torch only writes the ``.pt`` files, as upstream's ``torch.save`` does.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
from fastapi.testclient import TestClient

from mlx_chatterbox import TTS
from mlx_chatterbox.cli import main
from mlx_chatterbox.convert import ConversionError, _resolve_source, convert, prepare, source_variant
from mlx_chatterbox.generation.multilingual import MultilingualParams
from mlx_chatterbox.sampling import SamplingParams
from mlx_chatterbox.server.app import create_app
from mlx_chatterbox.server.voices import VoiceStore
from mlx_chatterbox.server.worker import SpeechJob, Worker
from mlx_chatterbox.variants import CHECKPOINTS
from tests.conftest import TINY_MODEL, TINY_MTL, TINY_MTL_V3, random_voice, write_upstream_checkpoint

pytest.importorskip("torch")  # writes the .pt files

TEXT = "Bonjour tout le monde."
KNOBS = dict(max_new_tokens=12, seed=3, cfm_steps=2, watermark=False)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtl")
    return {
        cfg.variant: convert(
            write_upstream_checkpoint(tmp / f"up-{cfg.variant}", cfg), tmp / cfg.variant, config=cfg
        )
        for cfg in (TINY_MTL, TINY_MTL_V3)
    }


@pytest.fixture(scope="module")
def v2(folders):
    return TTS.load(folders["multilingual"])


@pytest.fixture(scope="module")
def v3(folders):
    return TTS.load(folders["multilingual-v3"])


def test_conversion_reads_the_torch_state_dicts_and_records_the_variant(folders):
    for variant, folder in folders.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["variant"] == variant and source_variant(folder) == variant
        assert sorted(p.name for p in (folder / "tokenizer").iterdir()) == sorted(
            CHECKPOINTS[variant].tokenizer
        )
        assert config["networks"]["t3"]["text_vocab_size"] == 2454


def test_defaults_follow_the_upstream_code_of_each_checkpoint(v2, v3):
    """v2 is upstream 0.1.7's (repetition penalty 2.0, the alignment analyzer, not batchable); v3 HEAD's."""
    assert v2.speech.params_type is MultilingualParams and MultilingualParams().repetition_penalty == 2.0
    assert v2.speech.analyzer and not v2.speech.batchable
    assert v3.speech.params_type is SamplingParams and not v3.speech.analyzer and v3.speech.batchable


def test_language_is_required_validated_and_refused_by_english_models(v3, tmp_path):
    voice = random_voice()
    with pytest.raises(ValueError, match="needs a language .*: one of ar, da, de"):
        v3.generate(TEXT, voice, **KNOBS)
    with pytest.raises(ValueError, match="unsupported language 'xx'.* fr \\(French\\)"):
        v3.generate(TEXT, voice, language="xx", **KNOBS)
    assert v3.text_ids(TEXT, "FR") == v3.text_ids(TEXT, "fr")  # codes in any case, as upstream
    assert v3.text_ids(TEXT, "fr") != v3.text_ids(TEXT, "de")  # the [xx] tag leads
    english = TTS.load(
        convert(write_upstream_checkpoint(tmp_path / "up"), tmp_path / "en", config=TINY_MODEL)
    )
    with pytest.raises(ValueError, match="language='fr': the english model speaks English only"):
        english.generate("Hello.", voice, language="fr", **KNOBS)


def test_v3_cuts_the_last_tokens_audio_and_v2_does_not(v2, v3):
    """upstream HEAD: ``wav[: max(1, n - 1) * 960]`` after S3Gen; generate and stream agree on the length."""
    voice = random_voice()
    for tts, cut in ((v2, 0), (v3, 960)):
        tokens = tts.speech_tokens(TEXT, voice, language="fr", seed=3, max_new_tokens=12)
        full = tts.vocode(tokens, voice, cfm_steps=2, seed=3, watermark=False)
        wav = tts.generate(TEXT, voice, language="fr", **KNOBS)
        assert len(tokens) > 1 and np.array_equal(wav, full[: len(full) - cut])
        streamed = list(tts.stream(TEXT, voice, language="fr", **KNOBS))
        assert sum(len(c) for c in streamed) == len(wav)


def test_the_engine_serves_v3_and_refuses_v2(v2, v3):
    with pytest.raises(ValueError, match="decodes one request at a time .* serve multilingual-v3"):
        Worker(v2)
    voice = random_voice()
    alone = v3.generate(TEXT, voice, language="fr", **KNOBS)
    params = SamplingParams(max_new_tokens=12)
    with Worker(v3) as worker:
        job = SpeechJob(TEXT, voice, params, cfm_steps=2, seed=3, watermark=False, language="fr")
        (whole,) = list(worker.submit(job))
        streamed = np.concatenate(list(worker.submit(SpeechJob(**{**job.__dict__, "stream": True}))))
        with pytest.raises(ValueError, match="needs a language"):
            worker.submit(SpeechJob(TEXT, voice, params))
    assert np.array_equal(whole, alone) and len(streamed) == len(alone)


def test_the_server_takes_language(v3, tmp_path):
    voices = VoiceStore(tmp_path / "voices", builtin=random_voice(seed=5))
    body = dict(model="tiny", input=TEXT, response_format="wav", max_new_tokens=12, cfm_steps=2, stream=False)
    with Worker(v3) as worker, TestClient(create_app(worker, voices, model_name="tiny")) as client:
        ok = client.post("/v1/audio/speech", json={**body, "language": "fr"})
        missing = client.post("/v1/audio/speech", json=body)
        unknown = client.post("/v1/audio/speech", json={**body, "language": "xx"})
    assert ok.status_code == 200 and ok.content[:4] == b"RIFF"
    for response in (missing, unknown):
        assert response.status_code == 400 and response.json()["error"]["param"] == "language"


def test_say_and_tokens_take_language_through_the_cli(folders, tmp_path, capsys):
    folder = str(folders["multilingual-v3"])
    out, voice = tmp_path / "bonjour.wav", tmp_path / "voice.safetensors"
    random_voice().save(voice)
    args = ["--model", folder, "--voice", str(voice), "--max-new-tokens", "12", "--seed", "1"]
    assert main(["say", "Bonjour", "--language", "fr", "-o", str(out), "--cfm-steps", "2", *args]) == 0
    wav, rate = sf.read(out)
    assert rate == 24000 and len(wav) > 0
    assert main(["tokens", "Bonjour", "--language", "fr", *args]) == 0
    assert capsys.readouterr().out.split()
    # Checked before the model loads: the model is known from the folder.
    for extra, message in (
        ([], "the multilingual-v3 model needs --language: one of ar"),
        (["--language", "xx"], "unsupported language 'xx'"),
    ):
        assert main(["say", "Bonjour", "-o", str(out), *args, *extra]) == 1
        assert message in capsys.readouterr().err
    english = ["--model", "ResembleAI/chatterbox", "--language", "fr"]
    assert main(["say", "Bonjour", "-o", str(out), *english]) == 1
    assert (
        "--language is for the multilingual models; the english model speaks English only"
        in capsys.readouterr().err
    )


def test_a_repo_id_downloads_only_the_variants_files(monkeypatch, tmp_path):
    """ResembleAI/chatterbox holds the English and the multilingual models: a repo id alone means English, and
    --variant picks another; each downloads its own files only."""
    asked = []

    def fake_download(repo, revision=None, allow_patterns=()):
        asked.append(set(allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_download)
    for variant in (None, "multilingual-v3"):
        _, described = _resolve_source("ResembleAI/chatterbox", None, variant)
        assert described["variant"] == (variant or "english")
    assert asked == [set(CHECKPOINTS["english"].files), set(CHECKPOINTS["multilingual-v3"].files)]
    with pytest.raises(ConversionError, match="unknown variant 'klingon'"):
        _resolve_source("ResembleAI/chatterbox", None, "klingon")


def test_a_folder_with_both_multilingual_t3s_needs_the_variant(tmp_path, folders):
    src = write_upstream_checkpoint(tmp_path / "up", TINY_MTL)
    (src / CHECKPOINTS["multilingual-v3"].t3).write_bytes((src / CHECKPOINTS["multilingual"].t3).read_bytes())
    with pytest.raises(ConversionError, match="pass variant= to choose\\)$"):
        convert(src, tmp_path / "a", config=None)
    assert source_variant(
        prepare(src, variant="multilingual-v3", config=TINY_MTL_V3, cache_dir=tmp_path / "c")
    ) == ("multilingual-v3")
    with pytest.raises(ConversionError, match="holds the multilingual-v3 model, not multilingual"):
        prepare(folders["multilingual-v3"], variant="multilingual")
