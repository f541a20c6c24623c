"""The layers of ARCHITECTURE.md hold: every module is in the table, and no import points up.

Here, the tests that need no process; the others are in tests/e2e/test_architecture.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
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


def test_packages_of_one_layer_import_each_other_one_way_at_most() -> None:
    """Two packages of one layer may not import each other (``jobs`` and ``fault_tolerance`` once did, for a
    variable's name): what both need lives below both."""
    layers = _layers()
    arrows: set[tuple[str, str]] = set()
    for module, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddpkit."):
                source, target = _top(module), _top(node.module)
                if source != target and layers.get(source) == layers.get(target):
                    arrows.add((source, target))
    assert sorted((a, b) for a, b in arrows if (b, a) in arrows) == []


def _imports_within_packages() -> dict[str, set[str]]:
    """``{module: modules of its own package that it imports}``: every ``from ddpkit... import``, those under
    ``TYPE_CHECKING`` and inside functions included (a package's ``__init__`` left out: it exports)."""
    paths = dict(_modules())
    package = {module: module.rpartition(".")[0] for module, path in paths.items() if path.name != "__init__.py"}
    graph: dict[str, set[str]] = {module: set() for module in package}
    for module in package:
        for node in ast.walk(ast.parse(paths[module].read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddpkit"):
                for target in (node.module, *(f"{node.module}.{alias.name}" for alias in node.names)):
                    if package.get(target) == package[module] and target != module:
                        graph[module].add(target)
    return graph


def test_no_import_circles_inside_a_package() -> None:
    """Within a package, the modules' imports form no circle (each module can be read after those it uses)."""
    graph = _imports_within_packages()
    assert graph["ddpkit.training._loop"], "imports inside training/ were read"
    circles = []
    for start in graph:  # a path back to start through its own package's modules
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for target in graph[module]:
                if target == start:
                    circles.append(" -> ".join([*path, start]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    assert circles == [], "an import circle inside a package"


def _private_writes(tree: ast.AST) -> list[str]:
    """``obj._name = ...`` (also ``+=``, ``del`` and ``setattr(obj, "_name", ...)``) where ``obj`` is not ``self``
    or ``cls``: a module writing another object's private state."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            obj, name = [*node.args, None, None][:2]
            if isinstance(name, ast.Constant) and str(name.value).startswith("_") and not _is_own(obj):
                found.append(f"line {node.lineno}: setattr(..., {name.value!r})")
        for target in targets:
            for item in ast.walk(target):
                if (
                    isinstance(item, ast.Attribute)
                    and isinstance(item.ctx, ast.Store | ast.Del)
                    and item.attr.startswith("_")
                    and not item.attr.startswith("__")
                    and not _is_own(item.value)
                ):
                    found.append(f"line {item.lineno}: {ast.unparse(item)}")
    return found


def _is_own(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def test_no_module_writes_another_objects_private_attributes() -> None:
    writes = {}
    for _, path in _modules():
        if found := _private_writes(ast.parse(path.read_text())):
            writes[str(path.relative_to(PACKAGE))] = found
    # torch's own state, in the one module that reaches torch's private names: a Hugging Face stream's shard read
    # as in the main process (inside a DataLoader worker it would split itself over the workers again), and torch's
    # gloo options, which have no public setters (a replica group's gloo device on the address the others reach).
    torchs = writes.pop("_torch_private.py", [])
    assert sorted(found.partition(": ")[2] for found in torchs) == [
        "options._devices", "options._timeout", "worker._worker_info", "worker._worker_info",
    ], torchs  # fmt: skip
    assert writes == {}, "write through a public attribute or method of the object's own class"


def test_no_test_module_imports_another_test_module() -> None:
    """What several test modules share lives in tests/helpers.py, tests/builders.py or tests/support/ (or a
    script the tests run, such as tests/e2e/ft_trainloop.py): a test module imported by another runs its
    module-level set-up twice and hides what it shares."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
                if isinstance(node, ast.ImportFrom)
                else [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if any(name.startswith("tests.") and name.rpartition(".")[2].startswith("test_") for name in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def _calls(tree: ast.AST, name: str) -> list[int]:
    """The lines where ``tree`` calls a function or method named ``name``."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) == name or getattr(node.func, "id", None) == name)
    ]


def _names(*nodes: ast.AST) -> list[str]:
    """The names and attribute names in ``nodes`` (``step.batches()`` -> ``step``, ``batches``)."""
    return [
        getattr(node, "id", None) or getattr(node, "attr", "")
        for root in nodes for node in ast.walk(root) if isinstance(node, ast.Name | ast.Attribute)
    ]  # fmt: skip


def test_training_has_one_batch_body_one_epoch_loop_one_progress_bar_and_one_place_that_picks_the_driver() -> None:
    """The runner (training/_run.py) owns the per-batch body, the epochs and the bar; the step drivers (DDP's,
    fault tolerance's) only hand it steps. So in training/: ``training_step`` and the backward are called in one
    function, a ``for`` statement goes over a step's batches once, epochs begin (``begin_epoch``,
    ``on_epoch_begin``) only in the runner, one ``tqdm`` bar is made, and ``fault_tolerance is ...`` is asked
    only where the loop checks its arguments and where ``fit`` picks its driver."""
    sources = {path.name: path.read_text() for path in sorted((PACKAGE / "training").glob("*.py"))}
    trees = {name: ast.parse(text) for name, text in sources.items()}
    found: dict[str, list[str]] = {}
    for name, tree in trees.items():
        for what in ("training_step", "backward", "begin_epoch", "tqdm"):
            found.setdefault(what, []).extend(f"{name}:{line}" for line in _calls(tree, what))
        found.setdefault("on_epoch_begin", []).extend(
            f"{name}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value == "on_epoch_begin"
        )  # fmt: skip
        found.setdefault("for over batches", []).extend(
            f"{name}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.For) and any("batch" in word for word in _names(node.iter, node.target))
            and name != "_evaluation.py"  # predictions, not training
        )  # fmt: skip
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef):
                asked = [
                    node.lineno for node in ast.walk(function)
                    if isinstance(node, ast.Compare) and "fault_tolerance" in ast.unparse(node.left)
                    and isinstance(node.ops[0], ast.Is | ast.IsNot)
                ]  # fmt: skip
                if asked:
                    found.setdefault("fault_tolerance is", []).append(f"{name}:{function.name}")
    runner = [line for line in found["training_step"] if line.startswith("_run.py:")]
    assert found["training_step"] == runner, found["training_step"]
    assert len(runner) == 1, runner
    # _recipe.py: how a loss goes backward in the run's precision (the runner calls it)
    assert [line.split(":")[0] for line in found["backward"]] == ["_recipe.py", "_run.py"], found["backward"]
    assert [line.split(":")[0] for line in found["for over batches"]] == ["_run.py"], found["for over batches"]
    # begin_epoch: at an epoch's start, and where a fault-tolerant group takes a peer's state (the run's take_over,
    # with its checkpoints)
    assert sorted(line.split(":")[0] for line in found["begin_epoch"]) == ["_run.py", "_run_checkpoints.py"], found[
        "begin_epoch"
    ]
    assert {line.split(":")[0] for line in found["on_epoch_begin"]} == {"_run.py"}, found["on_epoch_begin"]
    assert len(found["tqdm"]) == 1, found["tqdm"]
    assert sorted(found["fault_tolerance is"]) == ["_loop.py:__init__", "_loop.py:fit"], found["fault_tolerance is"]


def test_the_plugins_are_siblings_and_the_loop_calls_only_what_their_parent_declares() -> None:
    """``DDPPlugin`` and ``FSDPPlugin`` both implement ``ParallelPlugin`` (as Lightning's DDP and FSDP strategies
    its ``ParallelStrategy``); neither is the other's child, and the training loop asks a plugin only what
    ``ParallelPlugin`` declares, so that a third plugin needs nothing else."""
    from ddpkit import DDPPlugin, FSDPPlugin, ParallelPlugin

    assert not issubclass(FSDPPlugin, DDPPlugin)
    assert not issubclass(DDPPlugin, FSDPPlugin)
    assert {DDPPlugin.__base__, FSDPPlugin.__base__} == {ParallelPlugin}
    declared = set(dir(ParallelPlugin))
    asked = set()
    for path in (PACKAGE / "training").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute | ast.Name):
                owner = node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id
                if owner == "plugin":
                    asked.add(node.attr)
    assert len(asked) >= 8, asked
    assert sorted(asked - declared) == []
    # What each plugin must say its own way is abstract in the parent: a plugin that leaves one out cannot be made.
    assert ParallelPlugin.__abstractmethods__ == {
        "configure_ddp", "on_after_setup_optimizers", "block_backward_sync", "checkpoint_state",
        "load_checkpoint_state", "full_state_dict",
    }  # fmt: skip


def test_no_module_over_400_lines_and_no_function_over_60_lines() -> None:
    """A module holds one concept and a function does one thing: a module of ddpkit is at most 400 lines, a
    function at most 60 (its docstring aside), so that a reader can hold either in mind at once."""
    long_modules, long_functions = [], []
    for module, path in _modules():
        text = path.read_text()
        if text.count("\n") > 400:
            long_modules.append(f"{module}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = node.body[0]
                documented = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                start = (first.end_lineno or first.lineno) + 1 if documented else first.lineno
                if (node.end_lineno or 0) - start + 1 > 60:
                    long_functions.append(f"{module}.{node.name} (line {node.lineno})")
    assert long_modules == []
    assert long_functions == []


def test_a_commit_says_what_happened_and_the_runner_names_no_driver_or_plugin() -> None:
    """Every step's ``commit`` returns a ``CommittedStep`` or a ``NotCommitted`` (again, or deferred), never
    ``None`` (which once meant "again" for one driver and "deferred" for the other); and the epoch runner
    (training/_run.py and its checkpoints) never names a driver or a plugin class: it asks them."""
    from ddpkit.training._driver import NotCommitted

    assert {member.name for member in NotCommitted} == {"AGAIN", "DEFERRED"}
    silent = []
    for path in sorted((PACKAGE / "training").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "commit":
                assert node.returns is not None, (path.name, node.lineno)
                assert "None" not in ast.unparse(node.returns), (path.name, node.lineno)
                returns = [r for r in ast.walk(node) if isinstance(r, ast.Return)]
                silent += [
                    f"{path.name}:{r.lineno}" for r in returns if r.value is None or ast.unparse(r.value) == "None"
                ]
    assert silent == []
    names = {"DDPSteps", "FaultTolerantSteps", "DDPPlugin", "FSDPPlugin", "TorchFT", "ReplicaGroup",
             "DistributedDataParallel", "FSDPModule"}  # fmt: skip
    for name in ("_run.py", "_run_checkpoints.py"):
        used = {node.id for node in ast.walk(ast.parse((PACKAGE / "training" / name).read_text()))
                if isinstance(node, ast.Name)}  # fmt: skip
        assert sorted(used & names) == [], name


def test_both_drivers_deal_by_one_rule_and_count_the_epoch_in_one_accumulator() -> None:
    """A step's deal, a batch's seed and its loss's divisor are written once (training/_deal.py) and both drivers
    use them: no other training module hashes a seed (``epoch_seed``), slices a step by worker or divides by a
    step's items itself; and the epoch's loss sums are ``RunState``'s alone (no driver keeps sums of its own)."""
    training = PACKAGE / "training"
    users: dict[str, set[str]] = {}
    for path in sorted(training.glob("*.py")):
        if path.name == "_deal.py":
            continue
        tree = ast.parse(path.read_text())
        called = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
        assert "epoch_seed" not in called, f"{path.name} seeds batches itself: use _deal.batch_seed"
        steps = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Subscript) and "::" in ast.unparse(n)]
        assert steps == [], f"{path.name} deals a step itself: use _deal.shares ({steps})"
        attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        own = {a for a in attributes if re.fullmatch(r"_\w*_(sums|tokens)", a)}  # RunState's are its own
        assert path.name == "_state.py" or not own, f"{path.name} keeps loss sums of its own: {own}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "ddpkit.training._deal":
                users[path.name] = {alias.name for alias in node.names}
    assert {"batch_seed", "step_divisor"} <= users.get("_steps.py", set()), users
    assert {"batch_seed", "step_divisor", "share_sizes"} <= users.get("_fault_tolerant.py", set()), users
    assert "shares" in users.get("_ahead.py", set()), users
