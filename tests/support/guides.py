"""What several test modules share: guides."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[2]


#: The README and the guides (the pages that include ARCHITECTURE, CONTRIBUTING and CHANGELOG hold no block).
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks() -> list[str]:
    """Every Python block of the pages, each once (the README and a guide may show the same example)."""
    every = [block for page in PAGES for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)]
    return list(dict.fromkeys(every))


def shell_blocks() -> dict[tuple[str, int], str]:
    """Every ``bash`` block of the README and the guides, by (page name, index on the page)."""
    return {
        (page.name, index): block
        for page in PAGES
        for index, block in enumerate(re.findall(r"```bash\n(.*?)```", page.read_text(), re.DOTALL))
    }


#: How the blocks that this test does not run itself run: the quick start is CI's own script, and the sbatch
#: scripts (the clusters guide's, the fault-tolerance guide's) are submitted to the two-node Slurm cluster by
#: tests/e2e/test_schedulers.py, which also runs the fault-tolerance guide's mpirun line on two "nodes"; the
#: sharded guide's language model is run by tests/e2e/test_sharded.py in float32 (where its bound is checked), the
#: TrainLoop guide's transformers model by tests/e2e/test_hf_models.py (with the hf extra).
ELSEWHERE = {("README.md", 0), ("getting-started.md", 0), ("installation.md", 0), ("clusters.md", 1),
             ("fault-tolerance.md", 4), ("fault-tolerance.md", 5), ("sharded.md", 1), ("trainloop.md", 0)}  # fmt: skip


#: What a block needs to run on one 2-core machine, by (page, index): ``nodes`` (2: every line that names
#: ``--nnodes 2`` is started twice at once, one "node" each, on loopback) and the text it changes, each with
#: its reason (``each``: what changes in each copy of such a line); ``expect`` is what the output must show
#: (``times`` lines that match it, all ``same`` if asked).
RUNS: dict[tuple[str, int], dict[str, Any]] = {
    # the second run finds the first's finished checkpoint in runs/digits, says so and reports its accuracy
    ("getting-started.md", 1): {
        "expect": r"after 5 epochs: (0\.9\d+)\n(.|\n)*already trained 5 of 5 epochs in runs/digits; nothing to do: "
        r"delete it, pass a new checkpoint_dir, or ask for more epochs\n(.|\n)*after 5 epochs: \1\n"
    },
    # what ddpkit detects (JSON), then the doctor's table over 2 ranks
    ("installation.md", 1): {"expect": r"\"environment\": \"local\"(.|\n)*size/rank: bytes of the result on each rank"},
    # 2 ranks train 2 epochs and checkpoint; 3 ranks go on to epoch 3; one process trains the 3: the same accuracy
    ("sharded.md", 0): {
        "expect": r"^2 ranks, 2 epochs: (.|\n)*^3 ranks, 3 epochs: validation accuracy (0\.\d{4}); rank 0 holds \d+ of "
        r"(\d+) bytes(.|\n)*^1 rank, 3 epochs: validation accuracy \2; rank 0 holds \3 of \3 bytes",
    },
    ("launching.md", 0): {"expect": r"2 ranks, 3 epochs: validation accuracy 0\.9(.|\n)*\"world_size\""},
    ("elastic.md", 0): {
        # a free port, the test's own folder, and 2 of the 20 epochs (which leave time to stop and add a node)
        "replace": {"29400": "{port}", "/tmp/elastic": "{home}/elastic", "--epochs 20": "--epochs 2"},
        "expect": r"\"accuracy\": 0\.9",
    },
    # each of the 3 groups prints its accuracy, the same
    ("fault-tolerance.md", 0): {"expect": r"^validation accuracy (0\.[89]\d\d)$", "times": 3, "same": True},
    # two groups of two ranks: each group's rank 0 prints, the same accuracy as the three groups above
    ("fault-tolerance.md", 1): {"expect": r"^validation accuracy (0\.[89]\d\d)$", "times": 2, "same": True},
    # the same two groups, each sharding the model over its two ranks
    ("fault-tolerance.md", 2): {"expect": r"^validation accuracy (0\.[89]\d\d)$", "times": 2, "same": True},
    ("fault-tolerance.md", 3): {
        "nodes": 2,
        # node001 is the lighthouse's node: 127.0.0.1 and a free port here; 2 ranks a node on 2 cores
        "replace": {"node001:29510": "127.0.0.1:{port}", "-n 4": "-n 2"},
        # both "nodes" are this machine, with one host name: each copy names its group
        "each": [
            {"--max-restarts": "--replica-id node-a --max-restarts"},
            {"--max-restarts": "--replica-id node-b --max-restarts"},
        ],
        "secret": True,
        "expect": r"^validation accuracy (0\.[89]\d\d)$",
        "times": 2,
        "same": True,
    },
    ("clusters.md", 0): {
        "nodes": 2,  # node001 is the first node's host name; the ranks of 4 GPUs a node are one CPU rank here
        "replace": {"node001:29400": "127.0.0.1:{port}", "-n 8": "-n 1", "train.py": "examples/train.py"},
        "secret": True,
        "expect": r"2 ranks, 3 epochs: validation accuracy 0\.9",
    },
    ("security.md", 0): {
        "nodes": 2,
        "replace": {
            "node001:29400": "127.0.0.1:{port}",
            "-n 8": "-n 1",
            "train.py": "examples/train.py",
            # the user's own script: this one checks that the line hands it the secret
            "python launch_my_job.py": """python -c 'import os; assert len(os.environ["DDPKIT_JOB_SECRET"]) == 64'""",
        },
        "expect": r"2 ranks, 3 epochs: validation accuracy 0\.9",
    },
}


def _guide_job_script(page: str = "clusters.md") -> str:
    guide = (ROOT / "docs" / page).read_text()
    found = re.search(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", guide, re.DOTALL)
    assert found is not None, f"{page} has no sbatch job script"
    return found.group(1)


def _guide_mpirun_line() -> str:
    guide = (ROOT / "docs" / "fault-tolerance.md").read_text()
    found = re.search(r"```bash\n(mpirun .*?)\n```", guide, re.DOTALL)
    assert found is not None, "fault-tolerance.md has no mpirun line"
    return found.group(1)
