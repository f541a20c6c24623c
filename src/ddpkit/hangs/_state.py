"""What each rank sends for a hang report: :class:`RankState`, as JSON through the process group's store.

Every field may be missing (a rank of an older ddpkit, or one whose flight
recorder was off): readers use ``.get``.
"""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = [
    "ChildStack",
    "Frame",
    "GroupState",
    "LastCollective",
    "RankState",
    "ThreadStack",
    "mark_model_position",
    "model_position",
]

#: A stack frame: ``[filename, line, function, source text]`` (the text may be ``""``).
Frame = list[Any]


class LastCollective(TypedDict, total=False):
    """The latest collective the flight recorder saw in one process group on this rank."""

    seq: int  # the group's collective sequence number
    op: str  # the recorder's profiling name, e.g. "gloo:all_reduce"
    sizes: list[Any]  # the input shapes
    dtypes: list[str]
    active: bool  # still in flight
    age: float  # seconds since it was called
    frames: list[Frame]  # where it was called, outermost first


class GroupState(TypedDict, total=False):
    """One process group as this rank knows it."""

    desc: str  # the group's description (its name when it has none)
    ranks: list[int] | None  # its members' global ranks, when the recorder knows them
    last: LastCollective


class ThreadStack(TypedDict, total=False):
    name: str
    main: bool
    frames: list[Frame]  # outermost first


class ChildStack(TypedDict, total=False):
    """A child process (a DataLoader worker): its stack as it dumped it, or a note when it did not."""

    pid: int
    name: str
    stack: str


class RankState(TypedDict, total=False):
    """One rank's answer to a hang report's request."""

    rank: int
    host: str
    pid: int
    groups: dict[str, GroupState]  # by the group's name
    threads: list[ThreadStack]  # the main thread first
    children: list[ChildStack]
    model: str  # the part of the model this rank last entered, when a sharded model marks it


_position: str | None = None


def mark_model_position(label: str | None) -> None:
    """Say which part of the model this rank is computing (``FSDPPlugin`` marks each unit's forward and
    backward, whose collectives gather and reduce that unit's shards); a hang report names it."""
    global _position
    _position = label


def model_position() -> str | None:
    """What :func:`mark_model_position` last said, or ``None``."""
    return _position
