"""Conversion of upstream-layout folders written without torch, its errors, and loading the result."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_chatterbox.convert import ConversionError, convert
from mlx_chatterbox.models.t3 import T3
from mlx_chatterbox.weights import load_folder
from tests.conftest import TINY, upstream_t3_weights, write_upstream_checkpoint


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir())


def test_converts_and_loads(tmp_path):
    src = write_upstream_checkpoint(tmp_path / "up")
    dst = convert(src, tmp_path / "mlx", t3_config=TINY)
    assert leftovers(dst) == ["config.json", "t3.safetensors", "tokenizer.json"]
    config = json.loads((dst / "config.json").read_text())
    assert (
        config["format"] == "mlx-chatterbox"
        and config["format_version"] == 1
        and config["dtype"] == "float32"
    )
    assert config["source"]["path"] == str(src.resolve()) and config["t3"]["hidden_size"] == 64
    folder = load_folder(dst)
    ref = upstream_t3_weights(TINY)
    np.testing.assert_array_equal(np.array(folder.t3.text_pos_emb.weight), ref["text_pos_emb.emb.weight"])
    np.testing.assert_array_equal(
        np.array(folder.t3.tfmr.layers[1].mlp.down_proj.weight), ref["tfmr.layers.1.mlp.down_proj.weight"]
    )
    assert folder.voice is None


@pytest.mark.parametrize("dtype, mx_dtype", [("bfloat16", mx.bfloat16), ("float16", mx.float16)])
def test_lower_precision(tmp_path, dtype, mx_dtype):
    dst = convert(write_upstream_checkpoint(tmp_path / "up"), tmp_path / "mlx", dtype=dtype, t3_config=TINY)
    folder = load_folder(dst)
    assert folder.config["dtype"] == dtype and folder.t3.speech_head.weight.dtype == mx_dtype


def corrupt(tmp_path, change):
    src = write_upstream_checkpoint(tmp_path / "up")
    weights = {k: mx.array(v) for k, v in upstream_t3_weights(TINY).items()}
    change(weights)
    mx.save_safetensors(str(src / "t3_cfg.safetensors"), weights)
    return src


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda w: w.pop("tfmr.layers.1.mlp.up_proj.weight"),
            "key 'tfmr.layers.1.mlp.up_proj.weight' is missing",
        ),
        (
            lambda w: w.update({"tfmr.layers.2.mlp.up_proj.weight": mx.zeros((2,))}),
            "unexpected key 'tfmr.layers.2",
        ),
        (lambda w: w.update({"speech_head.bias": mx.zeros((8194,))}), "unexpected key 'speech_head.bias'"),
        (
            lambda w: w.update({"text_emb.weight": mx.zeros((705, 64))}),
            r"text_emb.weight has shape \(705, 64\), expected \(704, 64\)",
        ),
    ],
)
def test_bad_weights_name_the_key_and_leave_nothing(tmp_path, change, message):
    src = corrupt(tmp_path, change)
    with pytest.raises(ConversionError, match=message) as err:
        convert(src, tmp_path / "mlx", t3_config=TINY)
    assert "t3_cfg.safetensors" in str(err.value)
    assert leftovers(tmp_path) == ["up"]


def test_full_size_config_rejects_a_tiny_checkpoint(tmp_path):
    with pytest.raises(ConversionError, match="t3_cfg.safetensors: key .* is missing|has shape"):
        convert(write_upstream_checkpoint(tmp_path / "up"), tmp_path / "mlx")
    assert leftovers(tmp_path) == ["up"]


def test_truncated_safetensors(tmp_path):
    src = write_upstream_checkpoint(tmp_path / "up")
    path = src / "t3_cfg.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ConversionError, match="t3_cfg.safetensors cannot be read as safetensors"):
        convert(src, tmp_path / "mlx", t3_config=TINY)
    assert leftovers(tmp_path) == ["up"]


@pytest.mark.parametrize("missing", ["t3_cfg.safetensors", "tokenizer.json"])
def test_missing_files(tmp_path, missing):
    src = write_upstream_checkpoint(tmp_path / "up")
    (src / missing).unlink()
    with pytest.raises(ConversionError, match=f"{missing} not found in {src}"):
        convert(src, tmp_path / "mlx", t3_config=TINY)
    assert leftovers(tmp_path) == ["up"]


def test_incompatible_tokenizer(tmp_path):
    src = write_upstream_checkpoint(tmp_path / "up")
    data = json.loads((src / "tokenizer.json").read_text())
    for token in data["added_tokens"]:
        if token["content"] == "[START]":
            token["id"] = 254
    data["model"]["vocab"] = {
        k: (254 if k == "[START]" else v)
        for k, v in data["model"]["vocab"].items()
        if v != 254 or k == "[START]"
    }
    (src / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"\[START\] is id 254 but the model's start-of-text token is 255"):
        convert(src, tmp_path / "mlx", t3_config=TINY)
    assert leftovers(tmp_path) == ["up"]


def test_destination_rules(tmp_path):
    src = write_upstream_checkpoint(tmp_path / "up")
    dst = tmp_path / "mlx"
    dst.mkdir()
    convert(src, dst, t3_config=TINY)  # an empty folder is fine
    with pytest.raises(ConversionError, match="already exists.*overwrite"):
        convert(src, dst, t3_config=TINY)
    (dst / "stale.txt").write_text("x")
    convert(src, dst, t3_config=TINY, overwrite=True)
    assert "stale.txt" not in leftovers(dst)


def test_sources_that_are_not_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ConversionError, match="downloading it from the Hugging Face Hub failed.*pass their folder"
    ):
        convert("ResembleAI/not-a-cached-repo", tmp_path / "mlx")
    with pytest.raises(ConversionError, match="neither a folder nor a Hugging Face repo id"):
        convert(str(tmp_path / "no" / "such" / "dir"), tmp_path / "mlx")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConversionError, match="is a file"):
        convert(tmp_path / "file", tmp_path / "mlx")
    with pytest.raises(ConversionError, match="dtype 'int8' is not supported"):
        convert(tmp_path, tmp_path / "mlx", dtype="int8")
    assert not (tmp_path / "mlx").exists()


def test_loading_errors_say_what_to_run(tmp_path):
    src = write_upstream_checkpoint(tmp_path / "up")
    with pytest.raises(
        ValueError, match="holds an upstream checkpoint; convert it first: mlx-chatterbox convert"
    ):
        load_folder(src)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_folder(tmp_path / "nothing")
    dst = convert(src, tmp_path / "mlx", t3_config=TINY)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(config, format_version=99)))
    with pytest.raises(ValueError, match="format version 99.*Convert the checkpoint again"):
        load_folder(dst)


def test_key_table_covers_every_parameter():
    ours = {k for k, _ in tree_flatten(T3(TINY).parameters())}
    targets = {t for t, _ in T3.checkpoint_table(TINY).values() if t is not None}
    assert ours == targets
