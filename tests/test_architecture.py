"""The layers of ARCHITECTURE.md hold: every module is in the table, and no import points up."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "src" / "ddpkit"


def _layers() -> dict[str, int]:
    """``{top-level module or package of ddpkit: layer}`` from the table in ARCHITECTURE.md."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    layers = {}
    for number, modules in re.findall(r"^\| (\d) \| ([^|]+) \|", text, re.MULTILINE):
        for name in re.findall(r"`(\w+)`", modules):
            layers[name] = int(number)
    return layers


def _top(module: str) -> str:
    """``ddpkit.samplers.order`` -> ``samplers``; ``ddpkit`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _modules() -> list[tuple[str, Path]]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)
        found.append((module, path))
    return found


def test_every_module_has_a_layer() -> None:
    layers = _layers()
    assert len(layers) > 30, "the table was read"
    assert sorted({_top(module) for module, _ in _modules()} - set(layers)) == []


def test_imports_only_go_down() -> None:
    layers = _layers()
    upward = []
    for module, path in _modules():
        mine = layers[_top(module)]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ddpkit":
                targets = [_top(node.module)] if node.module != "ddpkit" else [a.name for a in node.names]
                upward += [(module, t) for t in targets if t in layers and layers[t] > mine]
    assert upward == [], "an import points to a higher layer"
