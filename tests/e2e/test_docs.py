"""The README's quick start is what CI runs; every Python and shell block of the README and of the guides runs as
written; every file they link to exists; the CLI page names every command and variable.

Here, the tests that start fresh processes; the others are in tests/unit/test_docs.py.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit._trust.secret import write_secret_file
from tests.helpers import free_port, job_environment
from tests.support.guides import RUNS, python_blocks, shell_blocks

ROOT = Path(__file__).parents[2]


# --- every Python block runs as written -------------------------------------------------------

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _block_id(block: str) -> str:
    names = [path.name for path in EXAMPLES if path.read_text() == block]
    return names[0] if names else re.sub(r"\W+", "_", block.split("def ", 1)[-1].split("(", 1)[0])


def _run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_clean_env()
    )
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


def _clean_env() -> dict[str, str]:
    """A user's environment: no pytest worker variables, nothing ddpkit set in this process."""
    return job_environment()


@pytest.mark.parametrize("block", python_blocks(), ids=_block_id)
def test_every_python_block_of_the_readme_and_the_guides_runs_as_written(block: str, tmp_path: Path) -> None:
    """Each block in a fresh directory, as a user who copies it into a file; a test module under pytest."""
    if "def test_" in block:
        (tmp_path / "test_block.py").write_text(block)
        result = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_block.py"], tmp_path)
        assert "1 passed" in result.stdout
        return
    (tmp_path / "block.py").write_text(block)
    _run(["block.py"], tmp_path)


def test_the_torchrun_style_example_runs_under_ddpkit_run(tmp_path: Path) -> None:
    script = str(ROOT / "examples" / "train.py")
    result = _run(["-m", "ddpkit", "run", "-n", "2", script, "--epochs", "2"], tmp_path)
    (line,) = result.stdout.splitlines()
    assert line.startswith("2 ranks, 2 epochs: validation accuracy 0.9")
    assert result.stderr == "", "nothing but the script's own output"


# --- every shell block runs -------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", sorted(RUNS), ids=lambda key: f"{key[0]}-{key[1]}")
def test_every_shell_block_of_the_guides_runs(key: tuple[str, int], tmp_path: Path) -> None:
    """Line by line in a fresh folder with the checkout's examples and this environment as ``.venv``, HOME the
    folder; with the changes RUNS names and why."""
    run = RUNS[key]
    block = shell_blocks()[key]
    for old, new in run.get("replace", {}).items():
        block = block.replace(old, new.format(port=free_port(), home=tmp_path))
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parents[1])
    env = {**_clean_env(), "HOME": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    # The processes of a command share one pipe; unbuffered, a script's print (its text and its newline: two writes)
    # may have another process's line between its halves. Buffered, as a user's shell has it by default.
    env.pop("PYTHONUNBUFFERED", None)
    if run.get("secret"):
        write_secret_file(str(tmp_path / ".ddpkit-secret"))
    said = []
    for line in [line for line in block.splitlines() if line.strip() and not line.startswith("#")]:
        copies = run.get("nodes", 1) if "--nnodes 2" in line else 1
        start = functools.partial(subprocess.Popen, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)  # fmt: skip
        each = run.get("each", [{}] * copies) if copies > 1 else [{}]
        shells = [start(["bash", "-c", functools.reduce(lambda text, change: text.replace(*change), changes.items(),
                                                        line)]) for changes in each]  # fmt: skip
        for shell in shells:
            out, _ = shell.communicate(timeout=240)
            assert shell.returncode == 0, f"{line!r} failed ({shell.returncode}):\n{out}"
            said.append(out)
    output = "\n".join(said)
    found = re.findall(run["expect"], output, re.MULTILINE)
    assert len(found) >= run.get("times", 1), output
    if run.get("same"):
        assert len(set(found)) == 1, output
