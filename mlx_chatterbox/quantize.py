"""T3 weight quantization: which layers, how it is recorded in ``config.json``, and the bytes a decode step reads.

Only the Llama backbone's linear layers are quantized (``LAYER_MODULES`` of every layer: 97% of the bytes one
decode step reads). The speech head, the embeddings, the norms and the conditioning encoder keep the model
dtype; ``docs/adr/0008-quantization.md`` gives the measurements behind the choice.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .models.t3 import T3

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
# The quantized linear layers of each backbone layer, as attribute paths under ``tfmr.layers.<i>``.
LAYER_MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
RECORDED_MODULES = [f"tfmr.layers.*.{m}" for m in LAYER_MODULES]  # how config.json lists them


def check_quantization(bits: int, group_size: int) -> None:
    """Raise ValueError unless ``bits`` and ``group_size`` are supported."""
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"quantization bits {bits!r} are not supported; choose 4 or 8")
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise ValueError(
            f"quantization group size {group_size!r} is not supported; choose one of "
            f"{', '.join(map(str, GROUP_SIZES))}"
        )


def _is_backbone_linear(path: str, module: nn.Module) -> bool:
    if not isinstance(module, nn.Linear) or not path.startswith("tfmr.layers."):
        return False
    return path.split(".", 3)[3] in LAYER_MODULES  # "tfmr.layers.<i>.<module path>"


def quantize_t3(model: T3, bits: int, group_size: int = 64) -> T3:
    """Quantize the backbone's linear layers of ``model`` in place (``mlx.nn.quantize``: affine, one scale and
    bias per ``group_size`` inputs, both in the weight's dtype) and return it."""
    check_quantization(bits, group_size)
    if quantized_modules(model):
        raise ValueError("this T3 is already quantized")
    for path, m in sorted(model.named_modules(), key=lambda item: item[0]):
        if _is_backbone_linear(path, m) and m.weight.shape[1] % group_size:
            raise ValueError(
                f"{path} has {m.weight.shape[1]} inputs, not a multiple of the group size {group_size}; "
                "choose a group size that divides it"
            )
    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=_is_backbone_linear)
    return model


def quantized_modules(model: nn.Module) -> list[str]:
    """Attribute paths of the quantized linear layers of ``model``, sorted."""
    return sorted(path for path, m in model.named_modules() if isinstance(m, nn.QuantizedLinear))


def quantization_record(bits: int, group_size: int) -> dict:
    """The ``t3_precision.quantization`` entry of ``config.json`` for a T3 quantized by ``quantize_t3``."""
    check_quantization(bits, group_size)
    return {"bits": bits, "group_size": group_size, "modules": list(RECORDED_MODULES)}


def read_quantization_record(record: object, where: str) -> tuple[int, int] | None:
    """(bits, group size) from a ``t3_precision.quantization`` entry, or None for an unquantized T3.

    A malformed entry, or one listing other modules than this version quantizes, is a ValueError that names
    ``where`` (the config file) and the fix."""
    if record is None:
        return None
    fix = "convert the checkpoint again (mlx-chatterbox convert ... --quantize 4|8)"
    if not isinstance(record, dict) or set(record) != {"bits", "group_size", "modules"}:
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"{where}: t3_precision.quantization must hold bits, group_size and modules, found {found}; {fix}"
        )
    try:
        check_quantization(record["bits"], record["group_size"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}; {fix}") from None
    if record["modules"] != RECORDED_MODULES:
        raise ValueError(
            f"{where}: quantized modules {record['modules']!r} differ from the ones this mlx-chatterbox "
            f"quantizes ({RECORDED_MODULES}); {fix}"
        )
    return record["bits"], record["group_size"]


def t3_weight_bytes(model: T3) -> int:
    """Weight bytes one decode step reads: the backbone and the speech head, quantized weights with their
    scales and biases. (The two embedding rows a step looks up, 2 x hidden values, are left out.)"""
    parts = [model.tfmr.parameters(), model.speech_head.parameters()]
    return sum(v.nbytes for p in parts for _, v in tree_flatten(p) if isinstance(v, mx.array))
