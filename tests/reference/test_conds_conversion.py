"""The built-in voice: upstream ``conds.pt`` (written by upstream's own ``Conditionals.save``) -> our voice file."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import torch

from mlx_chatterbox.convert import ConversionError, convert
from mlx_chatterbox.weights import load_folder
from tests.conftest import TINY, TINY_MODEL, write_upstream_checkpoint

from . import oracle

pytestmark = pytest.mark.reference


def test_builtin_voice_round_trips_exactly(tmp_path):
    src = write_upstream_checkpoint(tmp_path / "up")
    conds = oracle.random_conds(TINY, seed=3, gen_tokens=37)
    conds.save(src / "conds.pt")
    voice = load_folder(convert(src, tmp_path / "mlx", config=TINY_MODEL)).voice
    np.testing.assert_array_equal(np.array(voice.speaker_emb), conds.t3.speaker_emb.numpy())
    np.testing.assert_array_equal(
        np.array(voice.t3_prompt_tokens), conds.t3.cond_prompt_speech_tokens.numpy()
    )
    np.testing.assert_array_equal(np.array(voice.s3gen_prompt_tokens), conds.gen["prompt_token"].numpy())
    np.testing.assert_array_equal(np.array(voice.s3gen_prompt_mel), conds.gen["prompt_feat"].numpy())
    np.testing.assert_array_equal(np.array(voice.xvector), conds.gen["embedding"].numpy())


def test_conds_saved_after_upstream_s3gen_ran_convert(tmp_path):
    """Upstream's ``S3Token2Mel.forward`` casts ``conds.gen``'s tensors to its float dtype in place, so a
    ``conds.pt`` saved after any ``generate()`` holds float32 token arrays; upstream loads it, and so do we.
    The cast is upstream's own code; the flow it would then run is a stand-in (its output is not needed)."""
    from chatterbox.models.s3gen.s3gen import S3Token2Mel

    src = write_upstream_checkpoint(tmp_path / "up")
    conds = oracle.random_conds(TINY, seed=5, gen_tokens=37)
    expected = conds.gen["prompt_token"].numpy().copy()
    s3gen = SimpleNamespace(
        device=torch.device("cpu"),
        dtype=torch.float32,
        meanflow=False,
        flow=SimpleNamespace(inference=lambda **_: (torch.zeros(1, 80, 4), None)),
    )
    S3Token2Mel.forward(s3gen, torch.tensor([[1, 2]]), None, None, ref_dict=conds.gen)
    assert conds.gen["prompt_token"].dtype == conds.gen["prompt_token_len"].dtype == torch.float32
    conds.save(src / "conds.pt")
    voice = load_folder(convert(src, tmp_path / "mlx", config=TINY_MODEL)).voice
    assert voice.s3gen_prompt_tokens.dtype == mx.int32
    np.testing.assert_array_equal(np.array(voice.s3gen_prompt_tokens), expected)


def conds_with(tmp_path, edit):
    src = write_upstream_checkpoint(tmp_path / "up")
    conds = oracle.random_conds(TINY)
    data = dict(t3=dict(conds.t3.__dict__), gen=dict(conds.gen))
    edit(data)
    torch.save(data, src / "conds.pt")
    return src


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d["gen"].update(embedding=torch.nn.Linear(2, 2)),
            "holds a torch.nn.modules.linear.Linear",
        ),
        (lambda d: d["t3"].update(speaker_emb=torch.zeros(256)), "speaker_emb must be a 2-d float array"),
        (lambda d: d["gen"].pop("embedding"), r"'gen' must hold exactly"),
        (lambda d: d.update(extra=1), "the file must hold exactly"),
        (lambda d: d["gen"].update(prompt_token_len=torch.tensor([3])), "prompt_token_len"),
        (lambda d: d["gen"].update(prompt_feat=torch.zeros(1, 7, 80)), "s3gen_prompt_mel must be"),
        (lambda d: d["t3"].update(clap_emb=torch.zeros(1, 2)), "clap_emb and prompt_feat_len must be None"),
        (
            lambda d: d["gen"].update(prompt_token=d["gen"]["prompt_token"].float() + 0.5),
            r"prompt_token \(float32\) holds values that are not whole numbers",
        ),
        (
            lambda d: d["gen"].update(prompt_token_len=torch.tensor([float("nan")])),
            r"prompt_token_len \(float32\) holds values that are not whole numbers",
        ),
        (
            lambda d: d["gen"]["prompt_token"].__setitem__((0, 3), 6561),
            r"prompt_token holds values outside \[0, 6561\)",
        ),
        (
            lambda d: d["t3"].update(cond_prompt_speech_tokens=-d["t3"]["cond_prompt_speech_tokens"].float()),
            r"cond_prompt_speech_tokens holds values outside \[0, 6561\)",
        ),
        (
            lambda d: d["gen"].update(prompt_token_len=torch.tensor([2.0**40])),
            r"prompt_token_len holds values outside \[0, 2147483647\)",
        ),
    ],
)
def test_bad_conds_name_the_problem_and_leave_nothing(tmp_path, edit, message):
    src = conds_with(tmp_path, edit)
    with pytest.raises(ConversionError, match=message) as err:
        convert(src, tmp_path / "mlx", config=TINY_MODEL)
    assert "conds.pt" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["up"]
