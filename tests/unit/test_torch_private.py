"""torch's and torchft's private names: every one behind ddpkit._torch_private, each still there, and a clear error
where one is gone."""

from __future__ import annotations

import ast
import importlib.util
import re
import threading
import types
from pathlib import Path

import pytest

from ddpkit import _torch_private
from ddpkit._torch_private import NAMES, PrivateName, PrivateNameError, check, module_global_swapped, private

PACKAGE = Path(__file__).parents[2] / "src" / "ddpkit"


def test_every_private_name_ddpkit_uses_is_in_this_torch_and_torchft() -> None:
    """What tools/torch-matrix.sh and tools/gpu-check.sh run on each release: a rename shows here, not in a job."""
    assert check(torchft=True) == {}


def test_a_missing_name_says_which_what_for_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(NAMES, "gone", PrivateName("torch.distributed", "_no_such_name", "the test's purpose"))
    monkeypatch.setitem(NAMES, "gone_module", PrivateName("torch._no_such_module", "x", "another purpose"))
    private.cache_clear()
    try:
        with pytest.raises(PrivateNameError) as gone:
            private("gone")
        with pytest.raises(PrivateNameError, match=r"torch\._no_such_module\.x, which ddpkit uses for another"):
            private("gone_module")
        assert set(check(torchft=False)) == {"gone", "gone_module"}
    finally:
        private.cache_clear()
    said = str(gone.value)
    import torch

    for part in ("torch.distributed._no_such_name", "the test's purpose", torch.__version__, "2.13", "install"):
        assert part in said


def test_a_module_global_comes_back_when_the_last_overlapping_block_closes() -> None:
    module = types.SimpleNamespace(thing="original")
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[str] = []

    def second() -> None:
        first_in.wait()
        with module_global_swapped(module, "thing", "replacement"):
            second_in.set()
            first_out.wait()
            seen.append(module.thing)  # the first block closed: still swapped for this one
        seen.append(module.thing)

    thread = threading.Thread(target=second)
    thread.start()
    with module_global_swapped(module, "thing", "replacement"):
        first_in.set()
        second_in.wait()
    first_out.set()
    thread.join(5)
    assert seen == ["replacement", "original"]
    assert module.thing == "original"
    assert not _torch_private._swapped


def _private_uses(path: Path) -> list[str]:
    """``file:line: name`` for each private name of torch or torchft that ``path`` reaches itself: imported from a
    private module, imported by a private name, or read as an attribute of a torch or torchft module."""
    tree = ast.parse(path.read_text())
    modules: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in _ROOTS}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _ROOTS:
            for alias in node.names:
                if _private(node.module) or _private(alias.name):
                    found.append(f"{path.name}:{node.lineno}: from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules and base.id not in _OBJECTS:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        named = isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.fullmatch(node.value)
        if named and _private(node.value):  # a module by its name: torchft_module("torchft._torchft")
            found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    return found


_ROOTS = ("torch", "torchft")
_DOTTED = re.compile(r"(torch|torchft)(\.\w+)+")
#: Names imported from torch that are objects, not modules: their private attributes are nn.Module's own.
_OBJECTS = {"nn"}


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def test_no_module_but_the_door_reaches_a_private_name_of_torch_or_torchft() -> None:
    uses = [use for path in sorted(PACKAGE.rglob("*.py")) if path.name != "_torch_private.py"
            for use in _private_uses(path)]  # fmt: skip
    assert uses == []


def test_the_scan_sees_each_kind_of_private_use(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.utils.data._utils import worker\n"
        "from torch.x import _hidden\n"
        "a = torch._foreach_norm\nb = dist.distributed_c10d._get_default_store\nc = torch.nn.Linear\n"
        "d = torchft_module('torchft._torchft')\n"
    )
    assert [use.split(": ", 1)[1] for use in _private_uses(sample)] == [
        "from torch.utils.data._utils import worker",
        "from torch.x import _hidden",
        "torch._foreach_norm",
        "dist.distributed_c10d._get_default_store",
        "'torchft._torchft'",
    ]


def test_an_older_torch_than_the_floor_is_refused_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch, "__version__", "2.5.1")
    spec = importlib.util.spec_from_file_location("probe_of_the_floor", _torch_private.__file__)
    assert spec is not None
    assert spec.loader is not None
    floor = ".".join(map(str, _torch_private.TORCH_FLOOR))
    with pytest.raises(ImportError, match=rf"ddpkit needs torch {floor} or newer and found torch 2\.5\.1") as old:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert f"pip install 'torch>={floor}'" in str(old.value)
