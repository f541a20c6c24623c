#!/usr/bin/env bash
# Build the documentation site (the guides in docs/, ARCHITECTURE, CONTRIBUTING, CHANGELOG and the API
# reference from the docstrings) with Sphinx into build/docs; open build/docs/index.html.
# Any warning fails the build: a broken reference to a page, a heading or one of ddpkit's names, a docstring
# that does not parse. Names of Python and torch link to their docs where docs.python.org and pytorch.org can
# be reached (intersphinx), else stay plain text; DDPKIT_DOCS_OFFLINE=1 skips trying.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf build/docs
"$PY" -m sphinx -W --keep-going -n -q -b html docs build/docs
echo "documentation: build/docs/index.html"
