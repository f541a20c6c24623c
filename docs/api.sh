#!/usr/bin/env bash
# Build the API reference from the docstrings with pdoc into build/api (open build/api/index.html).
# Any warning (an unresolvable annotation, a broken cross-reference) fails the build.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -W error -m pdoc -o build/api \
    ddpkit ddpkit.testing ddpkit.integrations.lightning ddpkit.examples.digits ddpkit.examples.retrieval
echo "API reference: build/api/index.html"
