"""The Lightning integration on a real ``Trainer(strategy="ddp", devices=2)``: sharded custom batch samplers and
validation metrics equal to a single-process evaluation of the same weights.

Here, the tests that start fresh processes; the others are in tests/unit/test_lightning.py and
tests/ranks/test_lightning.py.
"""

from __future__ import annotations

import subprocess
import sys


def test_the_core_package_imports_without_lightning() -> None:
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('lightning', 'pytorch_lightning'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import ddpkit, ddpkit.cli, ddpkit.examples.demo, ddpkit.examples.retrieval, ddpkit.integrations\n"
        "assert not [m for m in sys.modules if m.startswith(('lightning', 'pytorch_lightning'))]\n"
        "try:\n"
        "    import ddpkit.integrations.lightning\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (
        "needs Lightning 2.x, which is not installed: pip install lightning (ddpkit's lightning extra)" in done.stdout
    )
