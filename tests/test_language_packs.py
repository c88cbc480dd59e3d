"""Upstream's Single Language Pack (variants.PACKS): each pack converted from its own file layout, its one
language by default and only, its Hub download (the pack's repo plus ResembleAI/chatterbox's companions), and the
CLI and server with it. Parity with upstream's modules: tests/reference/test_mtl_e2e_parity.py."""

from __future__ import annotations

import dataclasses
import json
import tempfile

import numpy as np
import pytest
from fastapi.testclient import TestClient

from mlx_chatterbox import TTS
from mlx_chatterbox.cli import main
from mlx_chatterbox.convert import ConversionError, _resolve_source, convert, prepare, source_variant
from mlx_chatterbox.server.app import create_app
from mlx_chatterbox.server.voices import VoiceStore
from mlx_chatterbox.server.worker import Worker
from mlx_chatterbox.text import multilingual
from mlx_chatterbox.variants import CHECKPOINTS, COMPANION_REPO, PACKS, REPOS
from tests.conftest import TINY_MTL_V3, random_voice, write_upstream_checkpoint
from tests.toy_mtl_tokenizer import write_toy_pkuseg_home

pytest.importorskip("torch")  # writes the .pt files

KNOBS = dict(max_new_tokens=8, seed=3, cfm_steps=1, watermark=False)
TINY_PACKS = {variant: dataclasses.replace(TINY_MTL_V3, variant=variant) for variant in PACKS}


@pytest.fixture(scope="module")
def pt_br(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pt-br")
    cfg = TINY_PACKS["multilingual-v3-pt-br"]
    return TTS.load(convert(write_upstream_checkpoint(tmp / "up", cfg), tmp / "mlx", config=cfg))


@pytest.mark.parametrize("variant", list(PACKS))
def test_each_pack_converts_from_its_own_layout(variant, tmp_path, monkeypatch, request):
    repo, t3_file, language = PACKS[variant]
    if language == "zh":  # Chinese text is segmented by pkuseg: its toy model, not a download
        spacy_pkuseg = pytest.importorskip("spacy_pkuseg")
        monkeypatch.setattr(
            spacy_pkuseg.config, "pkuseg_home", str(write_toy_pkuseg_home(tmp_path / "pkuseg"))
        )
        multilingual._pkuseg_cut.cache_clear()
        request.addfinalizer(multilingual._pkuseg_cut.cache_clear)
    src = write_upstream_checkpoint(tmp_path / "up", TINY_PACKS[variant])
    assert sorted(p.name for p in src.iterdir()) == sorted(
        [t3_file, "s3gen_v3.pt", "ve.pt", "grapheme_mtl_merged_expanded_v1.json", "Cangjie5_TC.json"]
    )
    assert source_variant(src) == variant and source_variant(repo) == variant
    dst = convert(src, tmp_path / "mlx", config=TINY_PACKS[variant])  # the variant found from the T3 file
    assert json.loads((dst / "config.json").read_text())["variant"] == variant
    tts = TTS.load(dst)
    assert tts.speech.language == language and tts.speech.batchable and not tts.speech.analyzer
    assert tts.speech.cut_samples(8) == 960  # v3's trim
    # The pack's language is the default, and the only one.
    assert tts.text_ids("Hola.") == tts.text_ids("Hola.", language)
    assert tts.text_ids("Hola.")[0] == tts.tokenizer.encode("hola.", language)[0]  # the [xx] tag
    other = "fr" if language != "fr" else "de"
    with pytest.raises(ValueError, match=f"language='{other}': the {variant} model is a finetune for"):
        tts.text_ids("Hola.", other)


def test_a_pack_folder_without_the_companions_names_where_they_are(tmp_path):
    src = write_upstream_checkpoint(tmp_path / "up", TINY_PACKS["multilingual-v3-hi"])
    (src / "ve.pt").unlink()
    with pytest.raises(
        ConversionError, match=f"ve.pt not found in {src}; the multilingual-v3-hi model's repo"
    ):
        convert(src, tmp_path / "mlx", config=TINY_PACKS["multilingual-v3-hi"])


def test_a_pack_repo_id_downloads_the_pack_and_the_companions(monkeypatch, tmp_path):
    """The pack's repo holds T3, S3Gen and the grapheme tokenizer; ve.pt, conds.pt and Cangjie5_TC.json come
    from ResembleAI/chatterbox, as upstream's from_local and MTLTokenizer read them."""
    src = write_upstream_checkpoint(tmp_path / "all", TINY_PACKS["multilingual-v3-pt-br"])
    pack, shared = tmp_path / "hub" / "snapshots" / "packrev", tmp_path / "hub2" / "snapshots" / "baserev"
    asked = []
    for folder in (pack, shared):
        folder.mkdir(parents=True)

    def fake_download(repo, revision=None, allow_patterns=()):
        asked.append((repo, revision, sorted(allow_patterns)))
        folder = shared if repo == COMPANION_REPO else pack
        for name in allow_patterns:
            if (src / name).exists():
                (folder / name).write_bytes((src / name).read_bytes())
        return str(folder)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_download)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the folder of links goes
    local, described = _resolve_source(REPOS["multilingual-v3-pt-br"], "v1", None)
    companions = CHECKPOINTS["multilingual-v3-pt-br"].companions
    assert asked == [
        (
            "ResembleAI/Chatterbox-Multilingual-pt-br",
            "v1",
            sorted(["t3_pt_br.safetensors", "s3gen_v3.pt", "grapheme_mtl_merged_expanded_v1.json"]),
        ),
        (COMPANION_REPO, None, sorted(companions)),
    ]
    assert described == {
        "repo": "ResembleAI/Chatterbox-Multilingual-pt-br",
        "revision": "packrev",
        "companion": "ResembleAI/chatterbox@baserev",
        "variant": "multilingual-v3-pt-br",
    }
    assert local.parent == tmp_path / "mlx-chatterbox-packs"
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in src.iterdir())
    # Converted once into the cache, under both revisions.
    cfg = TINY_PACKS["multilingual-v3-pt-br"]
    dst = prepare(REPOS["multilingual-v3-pt-br"], revision="v1", config=cfg, cache_dir=tmp_path / "cache")
    assert dst.name == (
        "ResembleAI--Chatterbox-Multilingual-pt-br--packrev--ResembleAI--chatterbox--baserev--multilingual-v3-pt-br"
    )
    assert TTS.load(dst).speech.variant == "multilingual-v3-pt-br"


def test_say_and_serve_a_pack_without_a_language(pt_br, tmp_path, capsys):
    voice = random_voice(seed=5)
    voice.save(tmp_path / "v.safetensors")
    wav = pt_br.generate("Olá, tudo bem?", voice, **KNOBS)
    assert np.array_equal(wav, pt_br.generate("Olá, tudo bem?", voice, language="pt", **KNOBS))
    args = ["--model", str(pt_br.path), "--voice", str(tmp_path / "v.safetensors"), "--max-new-tokens", "4"]
    assert main(["say", "Olá.", "-o", str(tmp_path / "a.wav"), *args, "--cfm-steps", "1"]) == 0
    assert main(["say", "Olá.", "-o", str(tmp_path / "b.wav"), *args, "--language", "en"]) == 1
    assert (
        "--language en: the multilingual-v3-pt-br model is a finetune for 'pt' only"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "b.wav").exists()
    voices = VoiceStore(tmp_path / "voices", builtin=voice)
    with Worker(pt_br, max_batch=2) as worker:
        client = TestClient(create_app(worker, voices, model_name="pt-br"))
        body = {"model": "pt-br", "input": "Olá.", "response_format": "pcm", "stream": False}
        r = client.post("/v1/audio/speech", json=body | {"max_new_tokens": 4, "seed": 1})
        assert r.status_code == 200 and len(r.content) > 0
        r = client.post("/v1/audio/speech", json=body | {"language": "es"})
        assert r.status_code == 400 and "finetune for 'pt' only" in r.json()["error"]["message"]
