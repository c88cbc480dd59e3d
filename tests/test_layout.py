"""The import rules of style.md §3: torch never at run time, and imports only point down the levels."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_chatterbox"
FORBIDDEN = {"torch", "chatterbox", "transformers", "torchaudio", "librosa", "perth"}
# What each part of the package may import from the package itself (by top-level part name).
ALLOWED = {
    "_backend": set(),
    "models": {"models"},
    "audio": {"audio"},
    "text": {"text"},
    "sampling": set(),
    "torchfile": set(),
    "generation": {"models", "audio", "text", "sampling", "generation"},
    "variants": {"models"},
    "quantize": {"models"},
    "convert": {"models", "generation", "text", "torchfile", "variants", "quantize"},
    "weights": {"models", "generation", "text", "convert", "variants", "quantize"},
    "api": {
        "models",
        "audio",
        "generation",
        "text",
        "sampling",
        "weights",
        "convert",
        "variants",
        "hybrid",
        "_backend",
    },
    "cli": {
        "cli",
        "api",
        "convert",
        "sampling",
        "_backend",
        "quantize",
        "server",
        "variants",
        "bulk",
        "__version__",
    },
    # Bulk synthesis sits beside the server: it drives the server's engine (server.worker) over many items.
    "bulk": {"api", "generation", "sampling", "server"},
    # The vocoding process loads S3Gen alone (weights.load_s3gen), without a whole TTS.
    "server": {"api", "generation", "sampling", "audio", "_backend", "server", "weights", "__version__"},
    "hybrid": {"generation"},
    "__init__": {"_backend", "api", "convert", "sampling"},
    "__main__": {"cli"},
}


# The modules of models/ that are not networks: the KV cache, shared layers and kernels, bounds on queued work.
SHARED = ("cache", "layers", "memory")

# Hybrid mode imports torch and upstream inside the function that loads them, never at module level.
LAZY_TORCH = {"hybrid.py"}


def imports(path: Path, top_level_only: bool = False) -> list[tuple[str, int]]:
    """(absolute module name, level) for each import; relative ones resolved against the package."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                names = [".".join(base + ((node.module,) if node.module else ()))]
                if not node.module:
                    names = [".".join(base + (a.name,)) for a in node.names]
                found += [(n, node.level) for n in names]
            else:
                found.append((node.module, 0))
    return found


def test_no_torch_or_upstream_at_run_time():
    for path in PACKAGE.rglob("*.py"):
        for name, _ in imports(path, top_level_only=path.name in LAZY_TORCH):
            assert name.split(".")[0] not in FORBIDDEN, f"{path} imports {name}"


def test_imports_point_down_the_levels():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("").parts
        part = rel[0]
        for name, _ in imports(path):
            if not name.startswith("mlx_chatterbox"):
                continue
            target = name.split(".")
            if len(target) == 1:
                continue
            assert target[1] in ALLOWED[part], f"{path.relative_to(PACKAGE)} imports {name}"
            if part == "models" and target[1] == "models" and rel[-1] not in SHARED:
                # A network file may import only the shared modules, never another network.
                assert target[-1] in (*SHARED, "models"), f"{path} imports network {name}"
