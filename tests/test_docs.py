"""The README's quick start is what CI runs; every Python block of the README and of the guides in docs/ runs as
written; every file they link to exists; the CLI page names every command and variable."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block is not None, "the quick start has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_quick_start_is_two_commands_and_ci_runs_both_verbatim() -> None:
    commands = quick_start_commands()
    assert len(commands) == 2
    assert "ddpkit demo" in commands[0]
    assert "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert command in ci, f"CI does not run the README command {command!r}"


# --- every Python block runs as written -------------------------------------------------------

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


#: The README and the guides (the pages that include ARCHITECTURE, CONTRIBUTING and CHANGELOG hold no block).
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks() -> list[str]:
    return [block for page in PAGES for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)]


def _links(page: Path) -> list[str]:
    """The relative link targets of ``page`` (anchors cut; the docs build checks those)."""
    found = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    return [link.split("#")[0] for link in found if not link.startswith(("http://", "https://", "#", "mailto:"))]


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
    return {k: v for k, v in os.environ.items() if not k.startswith(("DDPKIT_", "PYTEST_", "RANK", "MASTER_"))}


def test_the_pages_link_every_example_file_and_every_linked_file_exists() -> None:
    linked = {(page.parent / link).resolve() for page in PAGES for link in _links(page)}
    assert {path.resolve() for path in EXAMPLES} <= linked, "an example file that no page links to"
    assert sorted(str(path) for path in linked if not path.exists()) == []
    assert len(python_blocks()) >= 7
    for path in EXAMPLES:  # a file a page shows is shown whole, as it is
        text = path.read_text()
        shown = [block for block in python_blocks() if block.splitlines()[0] == text.splitlines()[0]]
        assert shown in ([], [text], [text, text]), f"a page's copy of examples/{path.name} differs from the file"


@pytest.mark.e2e
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


@pytest.mark.e2e
@pytest.mark.timeout(180)  # two runs of the example (5 epochs each): 57 s on the idle 2-core machine
def test_the_train_loop_example_says_when_its_checkpoint_dir_holds_a_finished_run(tmp_path: Path) -> None:
    script = str(ROOT / "examples" / "train_loop.py")
    first = _run([script], tmp_path).stdout.splitlines()
    again = _run([script], tmp_path).stdout.splitlines()
    assert first[-1].startswith("validation accuracy after 5 epochs: 0.9")
    assert again == [
        "already trained 5 of 5 epochs in runs/digits; nothing to do: delete it, pass a new checkpoint_dir, "
        "or ask for more epochs",
        first[-1],
    ]


@pytest.mark.e2e
def test_the_torchrun_style_example_runs_under_ddpkit_run(tmp_path: Path) -> None:
    script = str(ROOT / "examples" / "train.py")
    result = _run(["-m", "ddpkit", "run", "-n", "2", script, "--epochs", "2"], tmp_path)
    (line,) = result.stdout.splitlines()
    assert line.startswith("2 ranks, 2 epochs: validation accuracy 0.9")
    assert result.stderr == "", "nothing but the script's own output"


# --- the CLI page -----------------------------------------------------------------------------------


def test_the_cli_page_names_every_command_and_every_ddpkit_variable() -> None:
    from ddpkit.cli import build_parser

    page = (ROOT / "docs" / "cli.md").read_text()
    commands = next(a for a in build_parser()._actions if a.choices and isinstance(a.choices, dict)).choices
    assert [name for name in commands if f"`ddpkit {name}" not in page] == []
    used = set(re.findall(r"DDPKIT_[A-Z_]+", "".join(p.read_text() for p in (ROOT / "src").rglob("*.py"))))
    assert sorted(name for name in used if f"`{name}`" not in page) == []
