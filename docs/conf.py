"""Sphinx configuration of ddpkit's documentation site (built by docs/build.sh into build/docs)."""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import ddpkit  # noqa: E402

project = "ddpkit"
author = "the ddpkit developers"
release = version = ddpkit.__version__
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "sphinxarg.ext",  # sphinx-argparse: the CLI page's options, from ddpkit's own parser
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "build.sh"]
html_theme = "furo"
html_title = f"ddpkit {release}"

# Markdown pages (MyST): headings get anchors that links can name (`page.md#a-heading`).
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# The docstrings are Google style with Sphinx roles; napoleon reads both as written.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_inherit_docstrings = False  # torch's own docstrings (autograd.Function's) are torch's to document

# A reference to something of ddpkit's that does not exist fails the build (-n -W in build.sh); names of
# other projects resolve through intersphinx where their inventories can be reached, else stay plain text.
nitpicky = True
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(torch|nn|abc|numpy|np|typing|typing_extensions|collections|concurrent|contextlib|pathlib|socket|"
        r"datetime|logging|os|io|types|enum|dataclasses|threading|multiprocessing|signal|subprocess|"
        r"lightning|pytorch_lightning|tqdm|torchft|matplotlib|datasets|Ellipsis|builtins)(\..*)?",
    ),
    (
        r"py:.*",
        r"(int|float|str|bool|bytes|dict|list|tuple|set|frozenset|object|type|None|Any|Callable|Iterator|"
        r"Iterable|Sequence|Mapping|Generator|Literal|TypeVar|Protocol|Exception|BaseException|"
        r"RuntimeError|ValueError|TypeError|TimeoutError|OSError|ImportError|KeyError|NotImplementedError|"
        r"PathLike|T|K|V|Path|Tensor|Module|DataLoader|Dataset|Sampler|Optimizer|DistributedSampler)",
    ),
    # Names in annotations that are not public on their own: type aliases, type variables, protocols and
    # private base classes (their pages would say less than the signature already does).
    (
        r"py:.*",
        r"(~?ddpkit\.[\w.]*\.)?(T|P|~P|Loaders|Mode|Split|StreamEnds|Scheduler|SchedulerFactory|Precision|"
        r"Interval|Criterion|TrainLoopView|HasCallbacks|SupportsMainAddress|SupportsClusterEnvironment|"
        r"EpochLayout|_Monitor|_MetricsLogger|RetrievalValidation|TrainingEpochs|StreamBatch|WrapPolicy|RecordServer|StepMetrics|LossSums|ActivationCheckpointingPolicy|"
        r"MetricSet|DefaultSteps)",
    ),
]


def _reachable(url: str) -> bool:
    """Whether ``url`` answers within 3 s (the docs build offline too: CI reaches only package registries)."""
    if os.environ.get("DDPKIT_DOCS_OFFLINE"):
        return False
    try:
        with urllib.request.urlopen(url, timeout=3):
            return True
    except OSError:
        return False


_inventories = {"python": "https://docs.python.org/3", "torch": "https://docs.pytorch.org/docs/stable"}
intersphinx_mapping = {name: (url, None) for name, url in _inventories.items() if _reachable(f"{url}/objects.inv")}


def _private(base: type) -> bool:
    """Whether ``base`` is private to ddpkit: in a ``ddpkit._module``, or named ``_Something``."""
    module = getattr(base, "__module__", "")
    return module.startswith("ddpkit") and ("._" in module or base.__name__.startswith("_"))


def _public_bases(app: object, name: str, obj: object, options: object, bases: list[type]) -> None:
    """A base class private to ddpkit shows as its own bases instead: ``Preempted`` is a ``SystemExit`` to its
    users, ``TensorBoardLogger`` a ``Callback`` (not a ``_MetricsLogger``)."""
    shown: list[type] = []
    for base in bases:
        while _private(base) and base.__bases__:
            base = base.__bases__[0]
        if base not in shown:
            shown.append(base)
    bases[:] = shown


def _no_none_return_type(app: object, domain: str, objtype: str, content: object) -> None:
    """Drop "Return type: None" (what a procedure returns says nothing), after autodoc added the types."""
    from docutils import nodes

    for fields in list(content.findall(nodes.field_list)):  # type: ignore[attr-defined]
        for field in list(fields):
            if field[0].astext() in ("rtype", "Return type") and field[1].astext().strip() == "None":
                fields.remove(field)
        if not len(fields):
            fields.parent.remove(fields)


def setup(app: object) -> None:
    app.connect("autodoc-process-bases", _public_bases)  # type: ignore[attr-defined]
    app.connect("object-description-transform", _no_none_return_type, priority=600)  # type: ignore[attr-defined]
