#!/usr/bin/env bash
# The unit and ranks tests on several torch releases: the floor, the one CI runs, the newest.
# Not CI: each release comes from the package index with its CUDA packages, several GB apiece.
#
#   bash tools/torch-matrix.sh                 # torch 2.11.0 (the floor), 2.13.0 (CI), 2.15.0 (the newest)
#   bash tools/torch-matrix.sh 2.14.1          # other releases
#   MATRIX_INSTALL_ONLY=1 bash tools/torch-matrix.sh   # make the environments, run nothing
#
# Each release gets a virtual environment of its own in .torch-matrix/<release> (kept: a second run reuses
# it) with ddpkit's dev extras, everything but torch pinned by constraints.txt. Then, in it:
#   ddpkit._torch_private.report()        (every private torch/torchft name ddpkit uses is there)
#   python -m pytest tests/unit tests/ranks
# One line per release goes to .torch-matrix/results.txt; each run's whole output to .torch-matrix/<release>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
releases=("$@")
[ ${#releases[@]} -gt 0 ] || releases=(2.11.0 2.13.0 2.15.0)
mkdir -p .torch-matrix
results=.torch-matrix/results.txt
for release in "${releases[@]}"; do
    env_dir=.torch-matrix/$release
    log=.torch-matrix/$release.log
    constraints=.torch-matrix/constraints-$release.txt
    sed "s/^torch==.*/torch==$release/" constraints.txt > "$constraints"
    if [ ! -x "$env_dir/bin/python" ]; then
        echo "torch $release: installing into $env_dir"
        # The machine's own pip settings may cap torch (a constraints file of their own): none are read here.
        if ! { python3 -m venv "$env_dir" &&
               PIP_CONFIG_FILE=/dev/null "$env_dir/bin/pip" install -q -c "$constraints" "torch==$release" &&
               PIP_CONFIG_FILE=/dev/null "$env_dir/bin/pip" install -q -c "$constraints" -e '.[dev]'; } > "$log" 2>&1; then
            echo "torch $release: install FAILED (see $log)" | tee -a "$results"
            rm -rf "$env_dir"
            continue
        fi
    fi
    installed=$("$env_dir/bin/python" -c 'import torch; print(torch.__version__)')
    [ "${MATRIX_INSTALL_ONLY:-0}" = 1 ] && { echo "torch $installed: installed"; continue; }
    echo "torch $installed: running the unit and ranks tests (output in $log)"
    start=$SECONDS
    "$env_dir/bin/python" -c "import sys; from ddpkit._torch_private import report; sys.exit(report())" >> "$log" 2>&1
    names=$?
    "$env_dir/bin/python" -m pytest -q -p no:cacheprovider tests/unit tests/ranks >> "$log" 2>&1
    tests=$?
    summary=$(grep -a -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$log" | tail -1 | tr -d '=')
    echo "torch $installed ($(date -u +%F)): private names $([ $names = 0 ] && echo ok || echo MISSING);" \
        "unit+ranks: ${summary:-no summary} ($((SECONDS - start)) s)" | tee -a "$results"
done
