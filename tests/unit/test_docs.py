"""The README's quick start is what CI runs; every Python and shell block of the README and of the guides runs as
written; every file they link to exists; the CLI page names every command and variable.

Here, the tests that need no process; the others are in tests/e2e/test_docs.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.guides import ELSEWHERE, PAGES, ROOT, RUNS, python_blocks, shell_blocks


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


def _links(page: Path) -> list[str]:
    """The relative link targets of ``page`` (anchors cut; the docs build checks those)."""
    found = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    return [link.split("#")[0] for link in found if not link.startswith(("http://", "https://", "#", "mailto:"))]


def test_install_lines_work_where_ddpkit_is_installed_from_its_checkout() -> None:
    """ddpkit is on no package index: no page, docstring or error message tells users to `pip install 'ddpkit[...]'`
    (an extra's packages by their own names, or `-e '.[extra]'` in the checkout)."""
    texts = [*PAGES, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "src" / "ddpkit").rglob("*.py"))]
    said = [f"{path.relative_to(ROOT)}" for path in texts if re.search(r"pip install '?ddpkit\[", path.read_text())]
    assert said == [], f"install lines that work only from a package index: {said}"


def test_every_long_page_has_sections() -> None:
    """A page over 80 lines has subheadings (the site's page contents, and anchors a link can name)."""
    flat = [page.name for page in PAGES if len(page.read_text().splitlines()) > 80
            and len(re.findall(r"^## ", page.read_text(), re.MULTILINE)) < 2]  # fmt: skip
    assert flat == [], f"long pages without subheadings: {flat}"


def test_every_fenced_block_says_its_language() -> None:
    """A fence without a language is coloured as Python by the docs site: output is ``text``."""
    bare = []
    for page in [*PAGES, ROOT / "CONTRIBUTING.md", ROOT / "ARCHITECTURE.md", ROOT / "CHANGELOG.md"]:
        inside = False
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            if line.startswith("```"):
                if not inside and line.strip() == "```":
                    bare.append(f"{page.name}:{number}")
                inside = not inside
    assert bare == [], f"fences without a language (`text` for output): {bare}"


def test_the_pages_link_every_example_file_and_every_linked_file_exists() -> None:
    linked = {(page.parent / link).resolve() for page in PAGES for link in _links(page)}
    assert {path.resolve() for path in EXAMPLES} <= linked, "an example file that no page links to"
    assert sorted(str(path) for path in linked if not path.exists()) == []
    assert len(python_blocks()) >= 7
    for path in EXAMPLES:  # a file a page shows is shown whole, as it is
        text = path.read_text()
        shown = [block for block in python_blocks() if block.splitlines()[0] == text.splitlines()[0]]
        assert shown in ([], [text]), f"a page's copy of examples/{path.name} differs from the file"


# --- the CLI page -----------------------------------------------------------------------------------


def test_the_cli_page_names_every_command_and_every_ddpkit_variable() -> None:
    from ddpkit.cli import build_parser

    page = (ROOT / "docs" / "cli.md").read_text()
    commands = next(a for a in build_parser()._actions if a.choices and isinstance(a.choices, dict)).choices
    assert [name for name in commands if f"`ddpkit {name}" not in page] == []
    used = set(re.findall(r"DDPKIT_[A-Z_]+", "".join(p.read_text() for p in (ROOT / "src").rglob("*.py"))))
    assert sorted(name for name in used if f"`{name}`" not in page) == []


def test_the_cli_page_lists_every_option_of_every_command_from_the_parser_itself() -> None:
    """The page's option lists are sphinx-argparse's rendering of ``ddpkit.cli.build_parser`` (when the site is
    built), so they cannot drift from ``--help``: the page names that parser, and what sphinx-argparse reads of it
    has every option of every command."""
    import argparse

    sphinxarg = pytest.importorskip("sphinxarg.parser", reason="the docs extra (sphinx-argparse) is not installed")
    from ddpkit.cli import build_parser

    page = (ROOT / "docs" / "cli.md").read_text()
    assert re.search(r"```\{eval-rst\}\n\.\. argparse::\n   :module: ddpkit\.cli\n   :func: build_parser\n", page)
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    rendered = {child["name"]: child for child in sphinxarg.parse_parser(parser)["children"]}
    assert sorted(rendered) == sorted(commands)
    for name, command in commands.items():
        listed = {flag for group in rendered[name].get("action_groups", []) for option in group["options"]
                  for flag in option["name"]}  # fmt: skip
        options = {flag for action in command._actions if action.help != argparse.SUPPRESS
                   for flag in action.option_strings} - {"-h", "--help"}  # fmt: skip
        assert options <= listed, f"ddpkit {name}: {sorted(options - listed)} not on the page"
    assert len({flag for action in commands["run"]._actions for flag in action.option_strings}) > 15


# --- every shell block runs -------------------------------------------------------------------------


def test_every_shell_block_of_the_readme_and_the_guides_is_run_by_a_test() -> None:
    blocks = shell_blocks()
    assert sorted(set(blocks) - ELSEWHERE - set(RUNS)) == [], "a new shell block: add it to RUNS (or ELSEWHERE)"
    assert sorted((ELSEWHERE | set(RUNS)) - set(blocks)) == [], "a block that moved: update RUNS and ELSEWHERE"
    for key in ("README.md", 0), ("getting-started.md", 0):
        assert blocks[key].splitlines() == quick_start_commands()  # and CI runs them: see the test above
    assert blocks["installation.md", 0].splitlines() == quick_start_commands()[:1]
    from tests.support.guides import _guide_job_script, _guide_mpirun_line

    assert _guide_job_script() == blocks["clusters.md", 1]
    assert _guide_job_script("fault-tolerance.md") == blocks["fault-tolerance.md", 4]
    assert _guide_mpirun_line() + "\n" == blocks["fault-tolerance.md", 5]
    for key, run in RUNS.items():
        for old in run.get("replace", {}):
            assert old in blocks[key], f"{key}: {old!r} is no longer in the block"


def test_the_pages_that_say_which_python_agree_with_the_troubleshooting_note() -> None:
    """The set-up says Python 3.11; the troubleshooting note asks for 3.11.8 or newer where DataLoaders have
    workers (a CPython fork deadlock): every page that gives the set-up says both."""
    note = (ROOT / "docs" / "hangs.md").read_text()
    assert "Use Python 3.11.8\n  or newer" in note
    for page in ("README.md", "docs/getting-started.md", "CONTRIBUTING.md"):
        words = " ".join((ROOT / page).read_text().split())
        assert "Python 3.11 (3.11.8 or newer where DataLoaders have workers" in words, page


def test_the_api_reference_has_every_name_of_ddpkit_once_on_a_page_of_its_topic() -> None:
    """``ddpkit``'s names are documented by topic (launching, data, collectives, the model side, TrainLoop,
    errors), not as one page in alphabetical order: each name on exactly one of those pages."""
    import ddpkit

    pages = ["launching", "data", "collectives", "model", "trainloop", "errors"]
    index = (ROOT / "docs" / "api" / "index.md").read_text()
    assert all(f"\n{page}\n" in index for page in pages)
    documented = [
        name
        for page in pages
        for name in re.findall(
            r"^\.\. auto(?:class|function):: (\w+)$", (ROOT / "docs" / "api" / f"{page}.md").read_text(), re.M
        )
    ]
    assert sorted(documented) == sorted(name for name in ddpkit.__all__ if name != "__version__")
