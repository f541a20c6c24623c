"""The hang report's analysis, from the ranks' answers as plain data: stragglers, mismatches, silent ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ddpkit.hangs._report import analyse, full_report, summary
from ddpkit.hangs._stacks import user_frame

USER = "/home/me/train.py"
TORCH = str(Path(torch.__file__).parent / "distributed" / "distributed_c10d.py")


def _state(
    rank: int, seq: int, op: str = "gloo:all_reduce", active: bool = True, line: int = 10, sizes: Any = ((7,),),
    group: str = "0", desc: str = "default_pg", ranks: Any = None,
) -> dict[str, Any]:  # fmt: skip
    last = {"seq": seq, "op": op, "sizes": [list(s) for s in sizes], "dtypes": ["Float"] * len(sizes),
            "active": active, "age": 4.2 if active else 9.0,
            "frames": [[USER, line, "train", ""], [TORCH, 3245, "all_reduce", ""]]}  # fmt: skip
    return {
        "rank": rank, "host": "node", "pid": 100 + rank,
        "groups": {group: {"desc": desc, "ranks": ranks, "last": last}},
        "threads": [{"name": "MainThread", "main": True, "frames": [[USER, line + 1, "train", "work()"]]}],
        "children": [],
    }  # fmt: skip


def test_ranks_below_the_highest_sequence_number_did_not_arrive() -> None:
    states = {0: _state(0, 8), 1: _state(1, 7, active=False, line=20), 2: _state(2, 8)}
    analysis = analyse(states, 3, 3.0)
    assert (analysis.stragglers, analysis.mismatched) == ([1], [])
    text = summary(analysis, "/tmp/report.txt")
    assert text.startswith(
        "ddpkit: the job hung: rank 1 did not arrive at all_reduce #8 (float32 [7]), in which ranks 0, 2 have "
        "waited 4.2 s (timeout 3 s)"
    )
    assert "  ranks 0, 2: in all_reduce #8 (float32 [7]) for 4.2 s, called at /home/me/train.py:10 in train" in text
    assert "  rank 1: in no collective (its last: all_reduce #7 (float32 [7])); now at /home/me/train.py:21" in text
    assert "> /home/me/train.py:21 in train: work()" in text, "user frames marked"
    assert text.endswith("Full report (every thread, every rank): /tmp/report.txt")


def test_the_unit_of_a_sharded_model_the_others_wait_in_is_named() -> None:
    states = {0: _state(0, 8, op="gloo:_allgather_base"), 1: _state(1, 7, active=False, line=20)}
    states[0]["model"] = "FSDP unit 'blocks.2' (forward)"
    states[1]["model"] = "FSDP unit 'blocks.1' (forward)"
    text = summary(analyse(states, 2, 3.0), None)
    assert text.startswith(
        "ddpkit: the job hung: rank 1 did not arrive at _allgather_base #8 (float32 [7]) of FSDP unit 'blocks.2' "
        "(forward), in which rank 0 has waited 4.2 s"
    ), text
    assert "  rank 0: in _allgather_base #8 (float32 [7]) of FSDP unit 'blocks.2' (forward) for 4.2 s" in text
    plain = summary(analyse({0: _state(0, 8), 1: _state(1, 7, active=False)}, 2, 3.0), None)
    assert " of " not in plain.splitlines()[0], "without a sharded model, nothing more"


def test_different_calls_at_one_sequence_number_name_the_odd_rank() -> None:
    states = {r: _state(r, 5) for r in range(4)}
    states[2] = _state(2, 5, op="gloo:broadcast", sizes=((5,),))
    analysis = analyse(states, 4, 3.0)
    assert (analysis.stragglers, analysis.mismatched) == ([], [2])
    assert "rank 2 called a different collective as #5 than the others" in summary(analysis, None)
    two = analyse({0: _state(0, 5), 1: _state(1, 5, op="gloo:barrier", sizes=())}, 2, 3.0)
    assert two.mismatched == [1], "on a tie, rank 0's call is the reference"


def test_a_rank_that_does_not_answer_is_named_and_explained() -> None:
    analysis = analyse({0: _state(0, 3)}, 2, 3.0)
    assert analysis.stragglers == [1]
    text = summary(analysis, None)
    assert "rank 1 did not arrive at all_reduce #3" in text
    assert "rank 1: did not answer within the report's deadline (stuck in C code that holds the GIL, or dead)" in text
    assert "===== rank 1 =====\ndid not answer" in full_report(analysis)


def test_every_rank_in_the_same_collective_means_the_collective_is_stuck() -> None:
    analysis = analyse({0: _state(0, 4), 1: _state(1, 4)}, 2, 3.0)
    assert (analysis.stragglers, analysis.mismatched) == ([], [])
    assert "every rank has been in all_reduce #4 (float32 [7]) for more than 3 s" in summary(analysis, None)


def test_only_the_members_of_a_subgroup_are_compared() -> None:
    states = {r: _state(r, 2, group="1", desc="pairs", ranks=[0, 1]) for r in (0, 1)}
    states[1]["groups"]["1"]["last"].update(seq=1, active=False)
    states[2] = _state(2, 0, active=False, group="1", desc="pairs", ranks=[0, 1])
    states[2]["groups"] = {}
    analysis = analyse(states, 3, 3.0)
    assert analysis.stragglers == [1], "rank 2 is not a member"
    assert "of process group 'pairs'" in summary(analysis, None)


def test_nobody_in_a_collective_is_no_verdict() -> None:
    analysis = analyse({0: _state(0, 4, active=False), 1: _state(1, 4, active=False)}, 2, 3.0)
    assert analysis.groups == []


def test_the_users_frame_is_the_innermost_outside_libraries() -> None:
    runpy = str(Path(__import__("runpy").__file__))
    frames = [[runpy, 1, "run", ""], [USER, 5, "main", ""], [USER, 9, "step", ""],
              [TORCH, 3, "all_reduce", ""]]  # fmt: skip
    assert user_frame(frames) == [USER, 9, "step", ""]
    assert user_frame([[TORCH, 3, "all_reduce", ""]]) is None
