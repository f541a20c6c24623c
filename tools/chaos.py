"""The chaos soak: many seeds of the chaos suite (tests/support/chaos.py), one after the other, and their figures.

    .venv/bin/python tools/chaos.py                       # seeds 1-20, 3 replica groups
    .venv/bin/python tools/chaos.py --seeds 21-30 --groups 4
    .venv/bin/python tools/chaos.py --seeds 1-3 --group-size 2   # groups of 2 ranks
    CHAOS_PLUGIN=fsdp .venv/bin/python tools/chaos.py --seeds 1-3 --group-size 2   # groups that shard the model
    .venv/bin/python tools/chaos.py --keep /tmp/chaos     # keep each run's folder (logs, output) there

Each seed runs ``ddpkit run --fault-tolerance -n GROUPS`` on the digits classifier (6 epochs, global batch 64) while
its schedule of faults fires: a kill, a kill right after the group comes back, a SIGSTOP stall of 4-8 s, two
groups killed together (and, with 4 groups or more, all but one), then checks what tests/e2e/test_chaos.py checks.
It prints a line per seed and, at the end, how many passed, the longest silence of any live group, and the time
from each fault to the next commit of the groups it left alone. Exit status 1 if any seed failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's tests package

from tests.support.chaos import check_chaos, run_chaos, schedule


def _seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1-20", help="FIRST-LAST (default 1-20)")
    parser.add_argument("--groups", type=int, default=3, help="replica groups (default 3)")
    parser.add_argument("--group-size", type=int, default=1, help="ranks per replica group (default 1)")
    parser.add_argument("--keep", default=None, help="a folder to keep each run's files in (default: removed)")
    args = parser.parse_args()
    passed, failed, silences, after = 0, [], [], []
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ddpkit-chaos-") as scratch:
        root = Path(args.keep or scratch)
        for seed in _seeds(args.seeds):
            faults = schedule(seed, args.groups, 6 * 23)
            run = run_chaos(seed, root / f"seed-{seed}", groups=args.groups, group_size=args.group_size)
            try:
                figures = check_chaos(run)
            except AssertionError as error:
                failed.append(seed)
                print(f"seed {seed}: FAILED ({run.seconds:.0f} s): {str(error).splitlines()[0][:300]}", flush=True)
                continue
            passed += 1
            silences.append(figures["longest_silence"])
            after.extend(figures["after_fault"])
            print(f"seed {seed}: ok in {figures['seconds']:.0f} s; {'; '.join(map(str, faults))}; longest silence "
                  f"{figures['longest_silence']:.2f} s; next commit after each fault "
                  f"{', '.join(f'{t:.2f}' for t in figures['after_fault'])} s", flush=True)  # fmt: skip
    print(f"\n{passed} of {passed + len(failed)} seeds passed ({args.groups} groups of {args.group_size} ranks, "
          f"{time.monotonic() - began:.0f} s)"
          + (f"; failed: {failed}" if failed else ""))  # fmt: skip
    if silences:
        print(f"longest silence of a live group: max {max(silences):.2f} s, median {statistics.median(silences):.2f} s")
        print(f"from a fault to the next commit of the groups it spared: median {statistics.median(after):.2f} s, "
              f"max {max(after):.2f} s ({len(after)} faults)")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
