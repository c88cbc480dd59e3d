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
from tests.conftest import (
    TINY,
    TINY_MODEL,
    upstream_s3gen_weights,
    upstream_t3_weights,
    write_upstream_checkpoint,
)


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir())


def test_converts_and_loads(tmp_path):
    src = write_upstream_checkpoint(tmp_path / "up")
    dst = convert(src, tmp_path / "mlx", config=TINY_MODEL)
    networks = ["campplus", "cfm", "flow", "hift", "s3tokenizer", "t3", "voice_encoder"]
    assert leftovers(dst) == sorted(
        ["config.json", "tokenizer.json"] + [f"{n}.safetensors" for n in networks]
    )
    config = json.loads((dst / "config.json").read_text())
    assert (
        config["format"] == "mlx-chatterbox"
        and config["format_version"] == 5
        and config["variant"] == "english"
        and config["dtype"] == "float32"
        and config["t3_precision"] == {"dtype": "float32", "quantization": None}
    )
    assert config["source"]["path"] == str(src.resolve()) and config["networks"]["t3"]["hidden_size"] == 64
    folder = load_folder(dst)
    assert folder.networks == TINY_MODEL
    ref = upstream_t3_weights(TINY)
    np.testing.assert_array_equal(np.array(folder.t3.text_pos_emb.weight), ref["text_pos_emb.emb.weight"])
    np.testing.assert_array_equal(
        np.array(folder.t3.tfmr.layers[1].mlp.down_proj.weight), ref["tfmr.layers.1.mlp.down_proj.weight"]
    )
    assert folder.voice is None
    # Every S3Gen-file network loads strictly; spot-check renames and layouts against the upstream tensors.
    s3gen = upstream_s3gen_weights()
    np.testing.assert_array_equal(
        np.array(folder.s3gen.flow.encoder_proj.weight), s3gen["flow.encoder_proj.weight"]
    )
    np.testing.assert_array_equal(  # Conv1d (out, in, k) -> (out, k, in)
        np.array(folder.s3gen.estimator.final_proj.weight),
        s3gen["flow.decoder.estimator.final_proj.weight"].transpose(0, 2, 1),
    )
    np.testing.assert_array_equal(  # ConvTranspose1d (in, out, k) -> (out, k, in)
        np.array(folder.s3gen.hift.ups[0].weight), s3gen["mel2wav.ups.0.weight"].transpose(1, 2, 0)
    )
    tokenizer, campplus = folder.load("s3tokenizer"), folder.load("campplus")
    np.testing.assert_array_equal(
        np.array(tokenizer.quantizer.project_down.weight),
        s3gen["tokenizer.quantizer._codebook.project_down.weight"],
    )
    assert campplus.config == TINY_MODEL.campplus
    assert folder.load("voice_encoder").lstm[2].weight_hh.shape == (128, 32)


def test_weight_norm_pairs_are_folded(tmp_path):
    src = write_upstream_checkpoint(tmp_path / "up")
    weights = {k: mx.array(v) for k, v in upstream_s3gen_weights().items()}
    v = weights.pop("mel2wav.ups.1.weight")  # ConvTranspose1d (in, out, k): the norm runs over (out, k)
    g = mx.array(np.linspace(0.5, 1.5, v.shape[0], dtype=np.float32).reshape(-1, 1, 1))
    weights["mel2wav.ups.1.parametrizations.weight.original0"] = g
    weights["mel2wav.ups.1.parametrizations.weight.original1"] = v
    mx.save_safetensors(str(src / "s3gen.safetensors"), weights)
    folder = load_folder(convert(src, tmp_path / "mlx", config=TINY_MODEL))
    v = np.array(v, dtype=np.float64)
    want = np.array(g) * v / np.sqrt((v**2).sum(axis=(1, 2), keepdims=True))
    np.testing.assert_allclose(np.array(folder.s3gen.hift.ups[1].weight), want.transpose(1, 2, 0), rtol=1e-6)


@pytest.mark.parametrize("dtype, mx_dtype", [("bfloat16", mx.bfloat16), ("float16", mx.float16)])
def test_lower_precision(tmp_path, dtype, mx_dtype):
    dst = convert(
        write_upstream_checkpoint(tmp_path / "up"), tmp_path / "mlx", dtype=dtype, config=TINY_MODEL
    )
    folder = load_folder(dst)
    assert folder.config["dtype"] == dtype and folder.t3.speech_head.weight.dtype == mx_dtype
    assert folder.config["t3_precision"] == {"dtype": dtype, "quantization": None}


def corrupt(tmp_path, change, filename="t3_cfg.safetensors"):
    """An upstream folder whose ``filename`` holds the random weights after ``change``."""
    src = write_upstream_checkpoint(tmp_path / "up")
    weights = upstream_t3_weights(TINY) if filename == "t3_cfg.safetensors" else upstream_s3gen_weights()
    weights = {k: mx.array(v) for k, v in weights.items()}
    change(weights)
    mx.save_safetensors(str(src / filename), weights)
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
        convert(src, tmp_path / "mlx", config=TINY_MODEL)
    assert "t3_cfg.safetensors" in str(err.value)
    assert leftovers(tmp_path) == ["up"]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda w: w.pop("flow.encoder.encoders.1.self_attn.pos_bias_u"),
            "key 'flow.encoder.encoders.1.self_attn.pos_bias_u' is missing",
        ),
        (
            lambda w: w.update({"flow.decoder.estimator.mid_blocks.5.0.mlp.1.bias": mx.zeros((32,))}),
            "unexpected key 'flow.decoder.estimator.mid_blocks.5",
        ),
        (lambda w: w.update({"vocoder.conv.weight": mx.zeros((2,))}), "unexpected key 'vocoder.conv.weight'"),
        (
            lambda w: w.update({"mel2wav.conv_pre.weight": mx.zeros((32, 80, 5))}),
            r"mel2wav.conv_pre.weight has shape \(32, 80, 5\), expected \(32, 80, 7\)",
        ),
        (
            lambda w: w.update({"mel2wav.conv_post.parametrizations.weight.original0": mx.ones((18, 1, 1))}),
            "key 'mel2wav.conv_post.parametrizations.weight.original1' is missing",
        ),
        (
            lambda w: w.update({"speaker_encoder.head.bn1.running_var": mx.ones((31,))}),
            r"speaker_encoder.head.bn1.running_var has shape \(31,\)",
        ),
    ],
)
def test_bad_s3gen_weights_name_the_key_and_leave_nothing(tmp_path, change, message):
    src = corrupt(tmp_path, change, "s3gen.safetensors")
    with pytest.raises(ConversionError, match=message) as err:
        convert(src, tmp_path / "mlx", config=TINY_MODEL)
    assert "s3gen.safetensors" in str(err.value)
    assert leftovers(tmp_path) == ["up"]


def test_s3gen_front_end_buffers_are_optional(tmp_path):
    # Upstream's S3Token2Wav.state_dict() holds the tokenizer's mel filters and window; the released file may not.
    def add(w):
        w["tokenizer._mel_filters"] = mx.zeros((128, 201))
        w["tokenizer.window"] = mx.zeros((400,))

    load_folder(convert(corrupt(tmp_path, add, "s3gen.safetensors"), tmp_path / "mlx", config=TINY_MODEL))


def test_full_size_config_rejects_a_tiny_checkpoint(tmp_path):
    with pytest.raises(ConversionError, match="t3_cfg.safetensors: key .* is missing|has shape"):
        convert(write_upstream_checkpoint(tmp_path / "up"), tmp_path / "mlx")
    assert leftovers(tmp_path) == ["up"]


def test_truncated_safetensors(tmp_path):
    src = write_upstream_checkpoint(tmp_path / "up")
    path = src / "t3_cfg.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ConversionError, match="t3_cfg.safetensors cannot be read as safetensors"):
        convert(src, tmp_path / "mlx", config=TINY_MODEL)
    assert leftovers(tmp_path) == ["up"]


@pytest.mark.parametrize(
    "missing", ["t3_cfg.safetensors", "s3gen.safetensors", "ve.safetensors", "tokenizer.json"]
)
def test_missing_files(tmp_path, missing):
    src = write_upstream_checkpoint(tmp_path / "up")
    (src / missing).unlink()
    with pytest.raises(ConversionError, match=f"{missing} not found in {src}"):
        convert(src, tmp_path / "mlx", config=TINY_MODEL)
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
        convert(src, tmp_path / "mlx", config=TINY_MODEL)
    assert leftovers(tmp_path) == ["up"]


def test_destination_rules(tmp_path):
    src = write_upstream_checkpoint(tmp_path / "up")
    dst = tmp_path / "mlx"
    dst.mkdir()
    convert(src, dst, config=TINY_MODEL)  # an empty folder is fine
    with pytest.raises(ConversionError, match="already exists; choose a new folder or pass overwrite=True$"):
        convert(src, dst, config=TINY_MODEL)
    (dst / "stale.txt").write_text("x")
    convert(src, dst, config=TINY_MODEL, overwrite=True)
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
    dst = convert(src, tmp_path / "mlx", config=TINY_MODEL)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(config, format_version=99)))
    with pytest.raises(ValueError, match="format version 99.*Convert the checkpoint again"):
        load_folder(dst)


def test_key_table_covers_every_parameter():
    ours = {k for k, _ in tree_flatten(T3(TINY).parameters())}
    targets = {t for t, *_ in T3.checkpoint_table(TINY).values() if t is not None}
    assert ours == targets


def test_prepare_converts_an_upstream_folder_once_and_reuses_it(tmp_path, caplog):
    import logging
    import os

    from mlx_chatterbox.convert import prepare

    src = write_upstream_checkpoint(tmp_path / "up")
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="mlx_chatterbox.convert"):
        first = prepare(src, cache_dir=cache, config=TINY_MODEL)
        again = prepare(src, cache_dir=cache, config=TINY_MODEL)
    assert first == again and first.parent == cache and caplog.text.count("converting") == 1
    assert prepare(first) == first  # a converted folder is used as it is
    with pytest.raises(ConversionError, match="already converted"):
        prepare(first, config=TINY_MODEL)
    # A changed checkpoint is a new cache entry.
    stamp = (src / "tokenizer.json").stat().st_mtime_ns + 10**9
    os.utime(src / "tokenizer.json", ns=(stamp, stamp))
    assert prepare(src, cache_dir=cache, config=TINY_MODEL) != first
    from mlx_chatterbox import TTS

    assert TTS.load(src, cache_dir=cache, config=TINY_MODEL).path.parent == cache
