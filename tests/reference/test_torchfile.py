"""The torch-free checkpoint reader against files written by the real torch.save (and upstream Conditionals)."""

import os
import pickle
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch

from mlx_chatterbox.torchfile import TorchFileError, load_torch_file

pytestmark = pytest.mark.reference


def _save(obj, tmp_path, name="x.pt", **kw):
    path = tmp_path / name
    torch.save(obj, path, **kw)
    return path


def _assert_same(got, ref):
    """got (numpy) equals ref (torch): values, dtype, shape; bf16 comes back widened to float32."""
    assert isinstance(got, np.ndarray) and got.flags.c_contiguous
    want = ref.float() if ref.dtype == torch.bfloat16 else ref
    assert got.dtype == want.numpy().dtype
    assert got.shape == tuple(ref.shape)
    np.testing.assert_array_equal(got, want.numpy())


def _rewrite_zip(src, dst, edit):
    """Copy a torch zip, letting edit(name, data) return new bytes or None to drop the record."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = edit(info.filename, zin.read(info))
            if data is not None:
                zout.writestr(info.filename, data)


def test_upstream_conds_round_trip(tmp_path):
    from chatterbox.models.t3.modules.cond_enc import T3Cond
    from chatterbox.tts import Conditionals

    g = torch.Generator().manual_seed(0)
    t3 = T3Cond(
        speaker_emb=torch.randn(1, 256, generator=g),
        clap_emb=None,
        cond_prompt_speech_tokens=torch.randint(0, 6561, (1, 150), generator=g),
        cond_prompt_speech_emb=None,
        emotion_adv=0.5 * torch.ones(1, 1, 1),
    )
    n = 37
    gen = dict(
        prompt_token=torch.randint(0, 6561, (1, n), generator=g),
        prompt_token_len=torch.tensor([n]),
        prompt_feat=torch.randn(1, 2 * n, 80, generator=g),
        prompt_feat_len=None,
        embedding=torch.randn(1, 192, generator=g),
    )
    path = tmp_path / "conds.pt"
    Conditionals(t3, gen).save(path)

    got = load_torch_file(path)
    assert list(got) == ["t3", "gen"]
    assert list(got["t3"]) == list(t3.__dict__) and list(got["gen"]) == list(gen)
    for ref_dict, got_dict in ((t3.__dict__, got["t3"]), (gen, got["gen"])):
        for k, ref in ref_dict.items():
            if ref is None:
                assert got_dict[k] is None
            else:
                _assert_same(got_dict[k], ref)
    assert got["t3"]["cond_prompt_speech_tokens"].dtype == np.int64
    assert got["gen"]["prompt_feat"].dtype == np.float32


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    ],
)
def test_dtypes(tmp_path, dtype):
    x = torch.arange(-6, 6).reshape(3, 4) * 1.25
    if dtype == torch.bool:
        x = x > 0
    elif dtype == torch.uint8:
        x = x.abs()
    x = x.to(dtype)
    if dtype == torch.bfloat16:  # values that bf16 holds exactly but float16 would round
        x = torch.tensor([1e30, -3.0e-30, 255.0, 0.0], dtype=torch.bfloat16)
    _assert_same(load_torch_file(_save({"x": x}, tmp_path))["x"], x)


def test_views_sharing_storage(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    refs = {
        "base": base,
        "t": base.transpose(0, 2),
        "perm": base.permute(1, 2, 0),
        "slice": base[1:, 1:3, ::2],
        "row": base[2, 3],
        "scalar_view": base[1, 2, 3],
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 5),
        "empty_view": base[:, 4:4],
        "expand": torch.arange(3.0).expand(4, 3),
    }
    path = _save(refs, tmp_path)
    got = load_torch_file(path)
    with zipfile.ZipFile(path) as zf:  # the views really share one storage record
        assert len([n for n in zf.namelist() if "/data/" in n]) == 4
    for k, ref in refs.items():
        _assert_same(got[k], ref)
    assert got["scalar"].shape == () and got["scalar_view"].shape == ()


def test_nested_dicts_and_ordered_dict(tmp_path):
    obj = {
        "a": OrderedDict(b=torch.ones(2), c=OrderedDict(d=None, e=3, f=2.5, g=True)),
        "h": {},
        "i": {"j": {"k": torch.zeros(1, dtype=torch.int32)}},
    }
    got = load_torch_file(_save(obj, tmp_path))
    assert list(got["a"]) == ["b", "c"] and got["a"]["c"] == {"d": None, "e": 3, "f": 2.5, "g": True}
    assert type(got["a"]["c"]["e"]) is int and type(got["a"]["c"]["g"]) is bool
    assert got["h"] == {}
    _assert_same(got["a"]["b"], obj["a"]["b"])
    _assert_same(got["i"]["j"]["k"], obj["i"]["j"]["k"])


def test_state_dict_and_parameters(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Conv1d(4, 2, 3))
    for sd in (m.state_dict(), m.state_dict(keep_vars=True)):  # keep_vars: nn.Parameter values
        got = load_torch_file(_save(sd, tmp_path))
        assert list(got) == list(sd)
        for k, ref in sd.items():
            _assert_same(got[k], ref.detach())


def test_big_endian(tmp_path):
    x = {
        "f": torch.linspace(-2, 2, 7),
        "i": torch.arange(5, dtype=torch.int64),
        "b": torch.ones(2).bfloat16(),
    }
    src = _save(x, tmp_path)
    sizes = {"0": 4, "1": 8, "2": 2}

    def swap(name, data):
        if name.endswith("/byteorder"):
            return b"big"
        key = name.rpartition("/data/")[2]
        if "/data/" in name and key in sizes:
            return np.frombuffer(data, f"<u{sizes[key]}").astype(f">u{sizes[key]}").tobytes()
        return data

    _rewrite_zip(src, tmp_path / "big.pt", swap)
    got = load_torch_file(tmp_path / "big.pt")
    for k, ref in x.items():
        _assert_same(got[k], ref)


def test_missing_file(tmp_path):
    with pytest.raises(TorchFileError, match="no such file"):
        load_torch_file(tmp_path / "nope.pt")


def test_legacy_format(tmp_path):
    path = _save({"x": torch.ones(2)}, tmp_path, _use_new_zipfile_serialization=False)
    with pytest.raises(TorchFileError, match=r"legacy.*re-save it with torch.save from torch >= 1.6"):
        load_torch_file(path)


def test_random_bytes(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(np.random.default_rng(0).bytes(1000))
    with pytest.raises(TorchFileError, match=r"junk.pt: is not a PyTorch zip checkpoint; re-save"):
        load_torch_file(path)


def test_truncated(tmp_path):
    path = _save({"x": torch.ones(100)}, tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TorchFileError, match="truncated or damaged zip"):
        load_torch_file(path)


def test_missing_data_record(tmp_path):
    src = _save({"a": {"x": torch.ones(3)}}, tmp_path)
    _rewrite_zip(src, tmp_path / "cut.pt", lambda n, d: None if n.endswith("/data/0") else d)
    with pytest.raises(
        TorchFileError, match=r"cut.pt: 'a' -> 'x' needs zip record 'x/data/0', which is missing"
    ):
        load_torch_file(tmp_path / "cut.pt")


def test_storage_too_small(tmp_path):
    src = _save({"x": torch.arange(10.0).reshape(2, 5)[:, 1:]}, tmp_path)
    _rewrite_zip(src, tmp_path / "short.pt", lambda n, d: d[:20] if n.endswith("/data/0") else d)
    with pytest.raises(TorchFileError, match=r"'x' needs 10 elements but its storage '0' holds 5"):
        load_torch_file(tmp_path / "short.pt")


def _with_pickle(tmp_path, payload: bytes, name="evil.pt"):
    """A valid torch zip whose data.pkl is replaced by payload."""
    src = _save({"x": torch.ones(1)}, tmp_path, name="src.pt")
    _rewrite_zip(src, tmp_path / name, lambda n, d: payload if n.endswith("/data.pkl") else d)
    return tmp_path / name


def test_os_system_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps({"gen": {"foo": Evil()}}, protocol=2)
    assert b"system" in payload
    path = _with_pickle(tmp_path, payload)
    with pytest.raises(
        TorchFileError, match=r"evil.pt: 'gen' -> 'foo' holds a (os|posix)\.system; only tensors"
    ):
        load_torch_file(path)
    assert not marker.exists()


def test_nn_module_is_refused(tmp_path):
    path = _save({"t3": {}, "gen": {"foo": torch.nn.Linear(2, 2)}}, tmp_path, name="conds.pt")
    with pytest.raises(
        TorchFileError,
        match=r"conds.pt: 'gen' -> 'foo' holds a torch.nn.modules.linear.Linear; only tensors, dicts, None and",
    ):
        load_torch_file(path)


@pytest.mark.parametrize(
    "value, what",
    [
        ("hello", "str value"),
        ([1, 2], "list value"),
        ((1,), "tuple value"),
        (torch.device("cpu"), "torch.device"),
        (1 + 2j, "builtins.complex"),
    ],
)
def test_disallowed_values(tmp_path, value, what):
    path = _save({"a": {"b": value}}, tmp_path)
    with pytest.raises(TorchFileError, match=rf"'a' -> 'b' holds a {what}"):
        load_torch_file(path)


def test_top_level_and_keys(tmp_path):
    with pytest.raises(TorchFileError, match="the top-level object holds a list value"):
        load_torch_file(_save([torch.ones(1)], tmp_path))
    with pytest.raises(TorchFileError, match="non-str key 3"):
        load_torch_file(_save({3: torch.ones(1)}, tmp_path))
    assert load_torch_file(_save(None, tmp_path)) is None
    _assert_same(load_torch_file(_save(torch.ones(2, 2), tmp_path)), torch.ones(2, 2))


def test_unsupported_storage_type(tmp_path):
    with pytest.raises(TorchFileError, match=r"'z' holds a torch.ComplexFloatStorage tensor"):
        load_torch_file(_save({"z": torch.ones(2, dtype=torch.complex64)}, tmp_path))


def test_garbage_pickle(tmp_path):
    with pytest.raises(TorchFileError, match="cannot unpickle"):
        load_torch_file(_with_pickle(tmp_path, b"\x80\x02}q\x00(garbage"))
