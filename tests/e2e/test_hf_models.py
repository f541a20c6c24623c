"""The TrainLoop guide's transformers example as its users run it: sharded under ``ddpkit run``, resumed in one
process, saved for ``from_pretrained``.

Here, the test that starts fresh processes; tests/ranks/test_hf_models.py has the others.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import job_environment
from tests.support.guides import shell_blocks

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")

ROOT = Path(__file__).parents[2]


@pytest.mark.timeout(600)
def test_the_guides_gpt2_trains_sharded_on_two_ranks_resumes_in_one_process_and_loads_with_from_pretrained(
    tmp_path: Path,
) -> None:
    """The guide's two lines, without dropout (where the bound holds), against one process uninterrupted."""
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    def run(*args: str) -> str:
        env = {**job_environment(), "PYTHONPATH": str(ROOT)}
        result = subprocess.run(
            [*args, "--dropout", "0"], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path
        )
        assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    sharded, resumed = (
        [sys.executable, "-m", *line.replace("examples/", f"{ROOT}/examples/").split()]
        if line.startswith("ddpkit")
        else [sys.executable, *line.replace("examples/", f"{ROOT}/examples/").split()[1:]]
        for line in shell_blocks()[("trainloop.md", 0)].splitlines()
    )
    first = run(*sharded)
    assert "FSDPPlugin: 3 units of their own (GPT2Block: transformer.h.0, transformer.h.1, transformer.h.2" in first
    assert re.search(r"^step 20 \(epoch 1\)  validation loss \d\.\d+  validation perplexity \d+\.\d+  validation "
                     r"token_accuracy 0\.\d+$", first, re.MULTILINE), first  # fmt: skip
    assert "epoch  2  stopped after step 30 (max_steps=30)" in first
    second = run(*resumed)
    assert "resuming from runs/gpt2: epoch 2, 216 entries into it, after 30 of 40 optimizer steps" in second
    alone = run(sys.executable, str(ROOT / "examples" / "hf_causal_lm.py"), "--save-pretrained", "alone")
    (last,) = (line for line in alone.splitlines() if line.startswith("after step 40:"))
    assert last in second.splitlines(), "the same validation loss, perplexity and token accuracy, to 4 decimals"
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "runs" / "gpt2-final").state_dict()
    uninterrupted = load_file(tmp_path / "alone" / "model.safetensors")
    assert max(float((loaded[k] - uninterrupted[k]).abs().max()) for k in uninterrupted) < 1e-5
