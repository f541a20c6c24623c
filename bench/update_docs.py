"""Run every benchmark and put its output into the documentation's Benchmarks page, with the machine it ran on.

    .venv/bin/python bench/update_docs.py [--only collectives,samplers,...]

Each benchmark's output replaces the text block after its marker in docs/benchmarks.md
(``<!-- bench/NAME.py -->``), headed by the CPU, core count, torch version and
date. Targets a benchmark misses are marked ``MISSED`` in its output. Takes a
few minutes; run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ("collectives", "samplers", "streams", "ddp_step", "watchdog", "microseconds", "fsdp")


def machine() -> str:
    """``AMD EPYC 7B13, 2 cores, Linux, torch 2.13.0+cpu``."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()}, torch {torch.__version__}"


def run(name: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py")], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return result.stdout.rstrip()


def replace_block(readme: str, name: str, output: str) -> str:
    """Replace the ```text block that follows ``<!-- bench/NAME.py -->``."""
    marker = f"<!-- bench/{name}.py -->"
    pattern = re.compile(re.escape(marker) + r"\n.*?```text\n.*?```\n", re.S)
    if not pattern.search(readme):
        raise SystemExit(f"docs/benchmarks.md has no {marker} followed by a ```text block")
    stamp = f"{marker}\nMeasured on {machine()}, {datetime.date.today():%Y-%m-%d}:\n\n```text\n{output}\n```\n"
    return pattern.sub(lambda _: stamp, readme, count=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated benchmark names")
    args = parser.parse_args()
    path = ROOT / "docs" / "benchmarks.md"
    readme = path.read_text(encoding="utf-8")
    for name in args.only.split(","):
        print(f"running bench/{name}.py ...", flush=True)
        readme = replace_block(readme, name, run(name))
    path.write_text(readme, encoding="utf-8")
    print("docs/benchmarks.md updated")


if __name__ == "__main__":
    main()
