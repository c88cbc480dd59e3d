"""Restricted, torch-free reader for PyTorch checkpoints (the zip format of ``torch.save``, torch >= 1.6).

Accepted content: dicts (``dict`` / ``collections.OrderedDict``) with str keys, tensors, ``None``, and Python
ints / floats / bools. Everything else is refused, including strings, lists and tuples as values (checkpoints
we read never need them, and refusing them keeps the result's shape predictable), any other pickled global
(classes, functions, ``torch.device``, ``nn.Module``, ...) and tensor subclasses or tensors with Python state.

The pickle never gets to run code: ``find_class`` hands out only our own data-only stand-ins, so
``torch._utils._rebuild_tensor_v2`` / ``_rebuild_parameter`` just record their arguments and an unknown global
becomes an inert placeholder, which is reported with its key path once loading is done.

Results: dicts come back as plain ``dict`` (insertion order kept; the ``_metadata`` attribute of a
``state_dict()`` is dropped), tensors as C-contiguous numpy arrays with stride and storage offset applied
(``requires_grad`` and ``nn.Parameter``-ness are dropped). numpy has no bfloat16, so BFloat16 tensors are
widened to float32, which is exact.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["TorchFileError", "load_torch_file"]

_DTYPES = {
    "FloatStorage": "f4",
    "DoubleStorage": "f8",
    "HalfStorage": "f2",
    "BFloat16Storage": "u2",  # raw bits; widened to float32 below
    "LongStorage": "i8",
    "IntStorage": "i4",
    "ShortStorage": "i2",
    "CharStorage": "i1",
    "ByteStorage": "u1",
    "BoolStorage": "?",
}
_ALLOWED = "only tensors, dicts, None and numbers are allowed"
# Legacy (pre-1.6 or _use_new_zipfile_serialization=False) files open with a pickled magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


class TorchFileError(ValueError):
    """A checkpoint could not be read, or holds something this restricted reader refuses."""


@dataclass(frozen=True)
class _StorageType:
    name: str


@dataclass(frozen=True)
class _Storage:
    stype: Any
    key: Any


@dataclass(frozen=True)
class _TensorRecord:
    args: tuple


class _Dict(dict):
    # Stand-in for OrderedDict; BUILD hands it instance state (a state_dict's `_metadata`), which we drop.
    def __setstate__(self, state: Any) -> None:
        pass


class _Rejected:
    """Inert stand-in for a refused global; calling or building it does nothing but remember the name."""

    qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def _rebuild_tensor_v2(*args: Any) -> _TensorRecord:
    return _TensorRecord(args)


def _rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None) -> Any:
    return data  # a Parameter is plain tensor data for our purposes


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "collections" and name == "OrderedDict":
            return _Dict
        if module == "torch" and name.endswith("Storage"):
            return _StorageType(name)
        module = "builtins" if module == "__builtin__" else module  # protocol-2 spelling, for messages
        # A type (not an instance), so NEWOBJ accepts it as well as REDUCE; nothing of the real global is touched.
        return type("Rejected", (_Rejected,), {"qualname": f"{module}.{name}"})

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent record {pid!r}")
        return _Storage(pid[1], pid[2])


class _Reader:
    def __init__(self, path: str, zf: zipfile.ZipFile, prefix: str, byteorder: str) -> None:
        self.path, self.zf, self.prefix, self.byteorder = path, zf, prefix, byteorder
        self.storages: dict[str, np.ndarray] = {}

    def fail(self, where: str, msg: str) -> TorchFileError:
        return TorchFileError(f"{self.path}: {where or 'the top-level object'} {msg}")

    def storage(self, st: _Storage, where: str) -> np.ndarray:
        if not isinstance(st.stype, _StorageType) or not isinstance(st.key, str):
            raise self.fail(where, f"holds a malformed storage record; {_ALLOWED}")
        if st.stype.name not in _DTYPES:
            raise self.fail(
                where, f"holds a torch.{st.stype.name} tensor, which is not supported; convert it first"
            )
        if st.key in self.storages:
            return self.storages[st.key]
        name = f"{self.prefix}data/{st.key}"
        try:
            raw = self.zf.read(name)
        except KeyError:
            raise self.fail(
                where, f"needs zip record {name!r}, which is missing; the file is truncated or damaged"
            ) from None
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise self.fail(where, f"cannot read zip record {name!r} ({e}); the file is damaged") from e
        dt = np.dtype(("<" if self.byteorder == "little" else ">") + _DTYPES[st.stype.name])
        arr = np.frombuffer(raw[: len(raw) - len(raw) % dt.itemsize], dtype=dt).astype(dt.newbyteorder("="))
        if st.stype.name == "BFloat16Storage":  # bf16 is the top half of a float32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        self.storages[st.key] = arr
        return arr

    def tensor(self, rec: _TensorRecord, where: str) -> np.ndarray:
        args = rec.args
        if not 6 <= len(args) <= 7 or not isinstance(args[0], _Storage):
            raise self.fail(where, f"holds a malformed tensor record; {_ALLOWED}")
        st, offset, size, stride, _requires_grad, hooks = args[:6]
        if hooks or (len(args) == 7 and args[6]):
            raise self.fail(
                where, "holds a tensor with hooks or metadata (conj/neg bits); save a plain tensor"
            )
        ints = [offset, *size, *stride] if isinstance(size, tuple) and isinstance(stride, tuple) else None
        if ints is None or len(size) != len(stride) or any(type(i) is not int or i < 0 for i in ints):
            raise self.fail(where, "holds a tensor with a malformed offset/size/stride")
        base = self.storage(st, where)
        if 0 in size:
            return np.empty(size, dtype=base.dtype)
        need = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
        if need > base.size:
            raise self.fail(
                where,
                f"needs {need} elements but its storage {st.key!r} holds {base.size}; the file is damaged",
            )
        strides = tuple(s * base.itemsize for s in stride)
        view = np.lib.stride_tricks.as_strided(base[offset:], shape=size, strides=strides, writeable=False)
        return view.copy(order="C")  # not ascontiguousarray: it turns 0-d into 1-d

    def convert(self, obj: Any, keys: tuple[str, ...], active: set[int]) -> Any:
        where = " -> ".join(repr(k) for k in keys)
        if obj is None or type(obj) in (bool, int, float):
            return obj
        if isinstance(obj, _TensorRecord):
            return self.tensor(obj, where)
        if type(obj) in (dict, _Dict):
            if id(obj) in active:
                raise self.fail(where, "holds a dict that contains itself")
            out = {}
            for k, v in obj.items():
                if not isinstance(k, str):
                    raise self.fail(where, f"holds a non-str key {k!r}; only str keys are allowed")
                out[k] = self.convert(v, keys + (k,), active | {id(obj)})
            return out
        if isinstance(obj, _Rejected) or (isinstance(obj, type) and issubclass(obj, _Rejected)):
            what = obj.qualname
        elif isinstance(obj, (_Storage, _StorageType)):
            what = "bare torch storage"
        else:
            what = f"{type(obj).__name__} value"
        raise self.fail(where, f"holds a {what}; {_ALLOWED}")


def _open_zip(path: str) -> zipfile.ZipFile:
    try:
        with open(path, "rb") as f:
            head = f.read(len(_LEGACY_MAGIC))
    except FileNotFoundError:
        raise TorchFileError(f"{path}: no such file; check the path") from None
    except OSError as e:
        raise TorchFileError(f"{path}: cannot be read ({e})") from e
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError):
        pass
    if head == _LEGACY_MAGIC:
        why = "is in PyTorch's legacy (pre-1.6) format"
    elif head.startswith(b"PK"):
        why = "is a truncated or damaged zip archive"
    else:
        why = "is not a PyTorch zip checkpoint"
    raise TorchFileError(f"{path}: {why}; re-save it with torch.save from torch >= 1.6 (default settings)")


def load_torch_file(path: str | os.PathLike) -> object:
    """Load a ``torch.save`` zip checkpoint as dicts / numpy arrays / None / numbers, without torch."""
    path = os.fspath(path)
    with _open_zip(path) as zf:
        pkls = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise TorchFileError(
                f"{path}: no single '<archive>/data.pkl' record; not a torch.save checkpoint"
            )
        prefix = pkls[0][: -len("data.pkl")]
        try:
            # Files without a byteorder record predate it and were written little-endian.
            names = set(zf.namelist())
            byteorder = zf.read(prefix + "byteorder").decode() if prefix + "byteorder" in names else "little"
            obj = _Unpickler(zf.open(pkls[0])).load()
        except TorchFileError:
            raise
        except Exception as e:  # anything from a malformed pickle or zip member
            raise TorchFileError(
                f"{path}: cannot unpickle {pkls[0]!r} ({type(e).__name__}: {e}); the file is damaged"
            ) from e
        if byteorder not in ("little", "big"):
            raise TorchFileError(f"{path}: unknown byteorder record {byteorder!r}")
        return _Reader(path, zf, prefix, byteorder).convert(obj, (), set())
