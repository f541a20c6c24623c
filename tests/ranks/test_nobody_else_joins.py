"""With a job secret, nobody else joins a job: the rendezvous is signed end to end (its state, bound to the job and
a counter; every key of a round), and every new process group proves its members before a tensor moves.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_nobody_else_joins.py
and tests/e2e/test_nobody_else_joins.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit import GroupProofError
from ddpkit._trust.group_proof import prove_members
from ddpkit.testing import run_parallel
from tests.helpers import JOB_SECRET

SECRET = JOB_SECRET.encode()


# --- every group proves its members --------------------------------------------------------------


def _prove(secrets: list[bytes], contexts: list[str]) -> str:
    """On a new group of every rank, prove with this rank's secret and context; what happened."""
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    try:
        prove_members(group, contexts[rank], secrets[rank], timeout=10)
    except GroupProofError as exc:
        return f"GroupProofError {sorted(exc.members)}: {exc}"
    finally:
        dist.destroy_process_group(group)
    return "proved"


def test_members_that_hold_the_secret_prove_it_and_a_member_with_another_is_named_by_every_rank() -> None:
    assert run_parallel(_prove, [SECRET, SECRET], ["job", "job"]) == ["proved", "proved"]
    results = run_parallel(_prove, [SECRET, b"another"], ["job", "job"])
    assert results[0].startswith("GroupProofError [1]: rank 1 of this process group could not prove"), results
    assert results[1].startswith("GroupProofError [0]: rank 0 of this process group could not prove"), results
    assert "its proof does not match" in results[0]
    assert "before any of the job's data moved through it" in results[0]


def test_a_proof_made_for_another_group_does_not_verify() -> None:
    """The context (the job, the store the members met at) is part of every proof."""
    results = run_parallel(_prove, [SECRET, SECRET], ["job|127.0.0.1:1000", "job|127.0.0.1:2000"])
    assert all(result.startswith("GroupProofError") for result in results), results


def _tensor_is_untouched() -> float:
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return value.item()


def test_the_pools_own_group_still_works_after_the_proofs() -> None:
    assert run_parallel(_tensor_is_untouched) == [1.0, 1.0]


def _timeout_after_a_refusal(secrets: list[bytes]) -> tuple[str, float | None]:
    """A new group with a 123 s timeout proves with this rank's secret; what happened, and its timeout after."""
    from datetime import timedelta

    from ddpkit._trust.group_proof import _timeout_of

    rank = dist.get_rank()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=123))
    try:
        prove_members(group, "job", secrets[rank], timeout=10)
        outcome = "proved"
    except GroupProofError:
        outcome = "refused"
    kept = _timeout_of(group)
    dist.destroy_process_group(group)
    return outcome, kept.total_seconds() if kept is not None else None


def test_a_group_keeps_its_own_timeout_after_its_proof_whether_it_passed_or_not() -> None:
    """The proof runs under its own (short) timeout, and gives the group its own back after, refused or not."""
    assert run_parallel(_timeout_after_a_refusal, [SECRET, SECRET]) == [("proved", 123.0)] * 2
    assert run_parallel(_timeout_after_a_refusal, [SECRET, b"another"]) == [("refused", 123.0)] * 2
