#!/usr/bin/env bash
# Everything ddpkit does on CUDA and NCCL, on a GPU machine, in one command; the results go to one file.
#
#   bash tools/gpu-check.sh [RESULTS]        (default: gpu-check.txt in the checkout)
#
# 1. torch with CUDA: the interpreter's own torch when it sees a GPU (PYTHON, default python3); else a
#    virtual environment .venv-gpu with the pinned CUDA wheel (torch 2.13.0, cu130) from download.pytorch.org.
# 2. ddpkit installed from this checkout into that interpreter, without touching its torch.
# 3. The CUDA tests (tests/gpu, with a hang report under NCCL on two GPUs, and the CUDA tests elsewhere in the
#    suite), `ddpkit demo` and `ddpkit doctor` on the GPU, and the bench rows on CUDA with their targets
#    (uneven gather and scalar mean against raw NCCL, the DDP step, the hang watchdog's cost on a CUDA step), and a
#    TrainLoop step under CUDA's sync debug mode at "error" (no step waits for the GPU), a
#    fault-tolerant TrainLoop of two torchft replica groups on the GPU against one process's weights, two groups
#    that each shard the model (FSDPPlugin), and (with 2 GPUs or more) two replica groups of 2 ranks each under
#    `ddpkit run --fault-tolerance --group-size 2`, DDP and sharded.
# Every step runs even when one before it failed; the exit status is 1 if any failed. Nothing here is CI:
# CI has no GPU and skips the CUDA tests.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-gpu-check.txt}
PY=${PYTHON:-python3}
failed=()
: >"$RESULTS"

say() { echo "$*" | tee -a "$RESULTS"; }
step() {  # step NAME COMMAND...: run it, its output into the results, and remember a failure
    local name=$1
    shift
    say ""
    say "=== $name: $*"
    local started=$SECONDS
    "$@" 2>&1 | tee -a "$RESULTS"
    local status=${PIPESTATUS[0]}
    say "=== $name: exit $status in $((SECONDS - started)) s"
    [ "$status" -eq 0 ] || failed+=("$name")
}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    say "no torch that sees a GPU in $PY: installing the pinned CUDA wheel into .venv-gpu"
    "$PY" -m venv .venv-gpu &&
        .venv-gpu/bin/pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130 &&
        PY=.venv-gpu/bin/python || { say "could not install torch with CUDA"; exit 1; }
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
# torchft (the ft extra) for the fault-tolerance test: from the index, or, on a machine with no network, from wheels
# put in .whl/ beforehand (torchft 0.2.0 and its opentelemetry packages; the test skips without it).
if ! "$PY" -c "import torchft" 2>/dev/null; then
    if ls .whl/torchft-*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --target .gpu-site .whl/*.whl && export PYTHONPATH=$PWD/.gpu-site
    else
        "$PY" -m pip install -q torchft==0.2.0 || say "missing: torchft (the fault-tolerance test skips)"
    fi
fi
for module in numpy tqdm pytest pytest_timeout hypothesis; do
    "$PY" -c "import $module" 2>/dev/null || "$PY" -m pip install -q "${module//_/-}" || say "missing: $module"
done

step machine bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c '
import torch, torch.distributed as dist
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"nccl\", \".\".join(map(str, torch.cuda.nccl.version())))
print(\"devices\", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
'"
# Every private torch/torchft name ddpkit uses, resolved on this machine's torch (none missing, or which).
step private-names "$PY" -c 'import sys; from ddpkit._torch_private import report; sys.exit(report())'
# tests/gpu holds the hang report under NCCL (it skips with one GPU: NCCL runs one rank per GPU).
step cuda-tests "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu \
    tests/ranks/test_gather.py::test_cuda_tensors_come_back_on_their_device tests/ranks/test_comm_hooks.py
step demo "$PY" -m ddpkit demo
step doctor "$PY" -m ddpkit doctor -n 1
step bench-collectives "$PY" bench/collectives.py --device cuda
step bench-ddp-step "$PY" bench/ddp_step.py --device cuda
step bench-watchdog "$PY" bench/watchdog.py --device cuda --blocks 20
# Two replica groups of one rank, each sharding the model (FSDP2 on CUDA; the groups share the one GPU).
step ft-sharded "$PY" -m ddpkit run --fault-tolerance -n 2 examples/fault_tolerant.py --sharded
# Two replica groups of 2 ranks (NCCL inside each group, torchft's gloo between them): 2 GPUs at least.
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)" -ge 2 ]; then
    step ft-groups-of-two "$PY" -m ddpkit run --fault-tolerance -n 4 --group-size 2 examples/fault_tolerant.py
    step ft-sharded-groups-of-two "$PY" -m ddpkit run --fault-tolerance -n 4 --group-size 2 \
        examples/fault_tolerant.py --sharded
else
    say ""
    say "=== ft-groups-of-two: skipped (a replica group of 2 ranks needs 2 GPUs: NCCL runs one rank per GPU)"
fi

say ""
if [ ${#failed[@]} -eq 0 ]; then
    say "gpu-check: every step passed (results in $RESULTS)"
else
    say "gpu-check: FAILED: ${failed[*]} (results in $RESULTS)"
    exit 1
fi
