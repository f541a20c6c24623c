"""What a hung job's ranks were doing, from their own answers: the analysis and the text of a hang report.

Pure functions over plain data, so that the analysis is tested without
processes. Each rank answers with a :data:`RankState`: per process group the
latest collective the flight recorder saw (sequence number, op, shapes,
dtypes, whether it is still in flight, where it was called) and the Python
stack of every thread. Collectives of one group complete only when every
member has entered them, so:

* members whose latest sequence number is below the group's highest did not
  arrive (they are in no collective of that group: the stragglers);
* members at the highest number that called different ops, shapes or dtypes
  called mismatched collectives;
* when every member sits in the same collective, the collective itself is stuck.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ddpkit.hangs._stacks import (
    ddpkit_collective,
    dumped_frames,
    frame_text,
    is_ddpkits,
    is_users,
    marked,
    user_frame,
)
from ddpkit.hangs._state import LastCollective, RankState

__all__ = ["GroupVerdict", "HangAnalysis", "analyse", "full_report", "summary"]


@dataclass
class GroupVerdict:
    """The state of one process group's collectives across its members."""

    name: str
    description: str
    members: list[int]
    highest: int
    arrived: list[int] = field(default_factory=list)
    stragglers: list[int] = field(default_factory=list)
    silent: list[int] = field(default_factory=list)
    #: Ranks at the highest number whose call differs from the most common one (from rank 0's on a tie).
    odd: list[int] = field(default_factory=list)

    @property
    def mismatched(self) -> bool:
        """Whether the members at the highest number called different collectives."""
        return bool(self.odd)

    @property
    def hung(self) -> bool:
        """Whether something is wrong in this group: a straggler, a mismatch, or every member stuck."""
        return bool(self.stragglers or self.silent or self.mismatched) or bool(self.arrived)


@dataclass
class HangAnalysis:
    """The verdicts of the groups in which some rank waits, and what every rank answered."""

    states: dict[int, RankState]
    world_size: int
    timeout: float
    groups: list[GroupVerdict]

    @property
    def stragglers(self) -> list[int]:
        """Ranks that did not arrive, or did not answer, in any group where others wait."""
        return sorted({r for g in self.groups for r in (*g.stragglers, *g.silent)})

    @property
    def mismatched(self) -> list[int]:
        """Ranks whose collective differs from the others' at the same sequence number."""
        return sorted({r for g in self.groups for r in g.odd})


def analyse(states: dict[int, RankState], world_size: int, timeout: float) -> HangAnalysis:
    """Compare the ranks' latest collectives group by group (only groups where some rank is in one)."""
    names: dict[str, tuple[str, list[int]]] = {}
    for state in states.values():
        for name, group in state.get("groups", {}).items():
            members = group.get("ranks") or list(range(world_size))
            names.setdefault(name, (group.get("desc", name), sorted(int(r) for r in members)))
    verdicts = []
    for name, (description, members) in sorted(names.items()):
        lasts = {r: _last(states[r], name) for r in members if r in states}
        if not any(last and last.get("active") for last in lasts.values()):
            continue  # nobody waits in this group
        highest = max((last["seq"] if last else 0) for last in lasts.values())
        verdict = GroupVerdict(name, description, members, highest)
        for rank in members:
            if rank not in states:
                verdict.silent.append(rank)
            elif (lasts[rank] or {}).get("seq", 0) < highest:
                verdict.stragglers.append(rank)
            else:
                verdict.arrived.append(rank)
        signatures = {r: _signature(lasts[r]) for r in verdict.arrived}
        if len(set(signatures.values())) > 1:
            counts = Counter(signatures.values())
            common = max(counts, key=lambda sig: (counts[sig], sig == signatures[verdict.arrived[0]]))
            verdict.odd = [r for r, sig in signatures.items() if sig != common]
        verdicts.append(verdict)
    default_first = sorted(verdicts, key=lambda v: (v.description != "default_pg", v.name))
    return HangAnalysis(states, world_size, timeout, default_first)


def summary(analysis: HangAnalysis, report_path: str | None) -> str:
    """The error text: what is stuck, who did not arrive, and every rank's state and stack (grouped)."""
    lines = [_headline(analysis)]
    lines.append("")
    lines.extend(_rank_lines(analysis))
    lines.append("")
    lines.append("Python stacks of the main threads (most recent call last; '>' marks your code):")
    lines.extend(_grouped_stacks(analysis))
    if report_path:
        lines.append("")
        lines.append(f"Full report (every thread, every rank): {report_path}")
    return "\n".join(lines)


def full_report(analysis: HangAnalysis) -> str:
    """The report file: the summary's verdict, then for each rank every thread, its latest collectives and
    its DataLoader workers' stacks."""
    lines = [_headline(analysis), ""]
    lines.extend(_rank_lines(analysis))
    for rank in range(analysis.world_size):
        state = analysis.states.get(rank)
        lines.append("")
        lines.append(f"===== rank {rank} =====")
        if state is None:
            lines.append("did not answer")
            continue
        lines.append(f"host {state.get('host')}, pid {state.get('pid')}")
        for name, group in sorted(state.get("groups", {}).items()):
            last = group.get("last")
            where = _describe_call(last) if last else "no collective yet"
            lines.append(f"group {group.get('desc', name)}: latest {where}")
            for frame in (last or {}).get("frames", []):
                lines.append(f"    {frame_text(frame)}")
        for thread in state.get("threads", []):
            lines.append(f"--- thread {thread.get('name')} (most recent call last):")
            lines.extend(f"    {marked(frame)}" for frame in thread.get("frames", []))
        for child in state.get("children", []):
            lines.append(f"--- child process {child.get('pid')} ({child.get('name', '')}):")
            lines.extend(f"    {line}" for line in str(child.get("stack", "")).splitlines())
    return "\n".join(lines) + "\n"


# --- text -------------------------------------------------------------------------------------------


def _headline(analysis: HangAnalysis) -> str:
    timeout = f"{analysis.timeout:g} s"
    if not analysis.groups:
        return f"ddpkit: the job hung: a rank waited in a collective for more than {timeout}"
    group = analysis.groups[0]
    where = "" if group.description == "default_pg" else f" of process group {group.description!r}"
    reference = next((analysis.states[r] for r in group.arrived), None)
    call = (
        _describe_call(_last(reference, group.name)) + _in_model(reference)
        if reference
        else f"collective #{group.highest}"
    )
    if group.mismatched:
        calls = "; ".join(f"rank {r}: {_op(_last(analysis.states[r], group.name))}" for r in group.arrived)
        odd = _ranks(group.odd)
        return (
            f"ddpkit: the job hung: {odd} called a different collective as #{group.highest}{where} than the others "
            f"({calls}), and they waited more than {timeout}"
        )
    if group.stragglers or group.silent:
        missing = _ranks(group.stragglers + group.silent)
        waiting = _ranks(group.arrived)
        waited = max((_age(analysis.states[r], group.name) for r in group.arrived), default=0.0)
        verb = "has" if len(group.arrived) == 1 else "have"
        return (
            f"ddpkit: the job hung: {missing} did not arrive at {call}{where}, in which {waiting} {verb} waited "
            f"{waited:.1f} s (timeout {timeout})"
        )
    return (
        f"ddpkit: the job hung: every rank has been in {call}{where} for more than {timeout}: the collective "
        "itself is stuck (a network or backend problem, or a timeout too short for it)"
    )


def _rank_lines(analysis: HangAnalysis) -> list[str]:
    """One line per rank (identical lines grouped): its collective, or none, and where its code is."""
    described: dict[str, list[int]] = {}
    for rank in range(analysis.world_size):
        described.setdefault(_rank_state(analysis, rank), []).append(rank)
    return [f"  {_ranks(ranks)}: {text}" for text, ranks in described.items()]


def _rank_state(analysis: HangAnalysis, rank: int) -> str:
    state = analysis.states.get(rank)
    if state is None:
        return "did not answer within the report's deadline (stuck in C code that holds the GIL, or dead)"
    group = analysis.groups[0] if analysis.groups else None
    last = _last(state, group.name) if group else None
    if last and last.get("active"):
        frames = last.get("frames", [])
        call = user_frame(frames)
        at = f", called at {frame_text(call)}" if call else ""
        if _in_final_barrier(frames):
            at = ": it returned from your function and waits for the others to finish (the launcher's last barrier)"
        text = f"in {_describe_call(last)}{_in_model(state)} for {float(last.get('age', 0.0)):.1f} s{at}"
    else:
        previous = f" (its last: {_describe_call(last)})" if last else ""
        text = f"in no collective{previous}"
        main = _main_frames(state)
        here = user_frame(main)
        if here is not None:
            text += f"; now at {frame_text(here)}"
        for child in state.get("children", []):
            here = user_frame(dumped_frames(str(child.get("stack", ""))))
            at = f", which is at {frame_text(here)}" if here else ""
            text += f"; waiting on its DataLoader worker (pid {child.get('pid')}){at}"
    return text


def _grouped_stacks(analysis: HangAnalysis) -> list[str]:
    stacks: dict[tuple[str, ...], list[int]] = {}
    for rank in range(analysis.world_size):
        state = analysis.states.get(rank)
        if state is None:
            continue
        frames = tuple(marked(frame) for frame in _from_users_code(_main_frames(state)))
        stacks.setdefault(frames, []).append(rank)
    lines = []
    for frames, ranks in stacks.items():
        lines.append(f"  {_ranks(ranks)}:")
        lines.extend(f"    {frame}" for frame in frames)
        rank = ranks[0]
        if _in_collective(analysis, rank):
            continue  # its workers only wait for it
        for child in analysis.states[rank].get("children", []):
            lines.append(f"    its DataLoader worker (pid {child.get('pid')}):")
            child_frames = _from_users_code(dumped_frames(str(child.get("stack", ""))))
            lines.extend(f"      {marked(frame)}" for frame in child_frames)
    return lines


def _in_model(state: RankState) -> str:
    """`` of FSDP unit 'blocks.2' (forward)``: the part of a sharded model whose collective the rank is in."""
    position = state.get("model")
    return f" of {position}" if position else ""


def _in_collective(analysis: HangAnalysis, rank: int) -> bool:
    last = _last(analysis.states.get(rank), analysis.groups[0].name) if analysis.groups else None
    return bool(last and last.get("active"))


def _describe_call(last: LastCollective | None) -> str:
    """``all_reduce #7 (float32 [7])``; ``all_to_all #3 (uint8 [8192]) in gather_all_tensors`` when a ddpkit
    collective the user called issued it."""
    if not last:
        return "no collective"
    api = ddpkit_collective(last.get("frames", []))
    return f"{_name(last)} #{last.get('seq')}{_shapes(last)}{f' in {api}' if api else ''}"


def _op(last: LastCollective | None) -> str:
    """``all_reduce (float32 [7])``."""
    return f"{_name(last)}{_shapes(last)}" if last else "no collective"


def _name(last: LastCollective) -> str:
    return str(last.get("op", "?")).split(":")[-1]


def _shapes(last: LastCollective) -> str:
    pairs = zip(last.get("sizes", []), last.get("dtypes", []), strict=False)
    shapes = ", ".join(f"{_DTYPES.get(str(dtype), str(dtype).lower())} {list(size)}" for size, dtype in pairs)
    return f" ({shapes})" if shapes else ""


#: The flight recorder's scalar type names, as torch's dtypes.
_DTYPES = {
    "Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
    "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool",
    "ComplexFloat": "complex64", "ComplexDouble": "complex128",
}  # fmt: skip


def _signature(last: LastCollective | None) -> tuple[Any, ...]:
    if not last:
        return ()
    return (last.get("op"), repr(last.get("sizes")), repr(last.get("dtypes")))


def _last(state: RankState | None, group: str) -> LastCollective | None:
    if state is None:
        return None
    last: LastCollective | None = state.get("groups", {}).get(group, {}).get("last")
    return last


def _age(state: RankState, group: str) -> float:
    last = _last(state, group)
    return float(last.get("age", 0.0)) if last else 0.0


def _main_frames(state: RankState) -> list[list[Any]]:
    threads = state.get("threads", [])
    main = next((t for t in threads if t.get("main")), threads[0] if threads else None)
    return list(main.get("frames", [])) if main else []


def _from_users_code(frames: list[list[Any]]) -> list[list[Any]]:
    """The frames from the outermost frame of the user's code on; without one, from ddpkit's first frame (or
    the last eight)."""
    first = next((i for i, frame in enumerate(frames) if is_users(str(frame[0]))), None)
    if first is None:
        first = next((i for i, f in enumerate(frames) if is_ddpkits(str(f[0]))), None)
    return frames[first:] if first is not None else frames[-8:]


def _in_final_barrier(frames: list[list[Any]]) -> bool:
    """Whether a collective was called by the barrier that ddpkit's workers run after the user's function."""
    worker = os.path.join("ddpkit", "_worker.py")
    return user_frame(frames) is None and any(str(f[0]).endswith(worker) and f[2] == "run_as_rank" for f in frames)


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0, 2`` or ``ranks 0-5, 7`` (consecutive runs folded)."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return "ranks " + ", ".join(parts)
