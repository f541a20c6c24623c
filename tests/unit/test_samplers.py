"""DistributedSamplerWrapper and DDPSamplerWrapper: sharding invariants, epochs, agreement across ranks.

Here, the tests that need no process; the others are in tests/ranks/test_samplers.py.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from ddpkit import DDPSamplerWrapper, DistributedSamplerWrapper
from ddpkit.ordered import _place
from tests.support.samplers import GlobalRandomSampler


class ReversedSampler(Sampler[int]):
    """A custom sampler: the generic (non tensor) path."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        return iter(range(self.n - 1, -1, -1))


def base_sampler(kind: str, n: int, batch: int | None, batch_drop: bool) -> Any:
    inner: Any = {
        "sequential": lambda: SequentialSampler(range(n)),
        "random": lambda: RandomSampler(range(n)),  # no generator: the wrapper must seed it
        "seeded": lambda: RandomSampler(range(n), generator=torch.Generator().manual_seed(11)),
        "custom": lambda: ReversedSampler(n),
        "global": lambda: GlobalRandomSampler(n),
    }[kind]()
    return BatchSampler(inner, batch, batch_drop) if batch else inner


shards = st.fixed_dictionaries(
    {
        "n": st.integers(0, 60),
        "world": st.integers(1, 5),
        "drop_last": st.booleans(),
        "even": st.booleans(),
        "shuffle": st.booleans(),
        "kind": st.sampled_from(["sequential", "random", "seeded", "custom", "global"]),
        "batch": st.none() | st.integers(1, 7),
        "batch_drop": st.booleans(),
        "seed": st.integers(0, 1000),
    }
)


def flatten(entries: list[Any]) -> list[int]:
    return [i for e in entries for i in (e if isinstance(e, list) else [e])]


@settings(max_examples=300)
@given(shards)
def test_sharding_invariants(case: dict[str, Any]) -> None:
    n, world = case["n"], case["world"]
    assume(n > 0 or case["kind"] not in ("random", "seeded"))  # torch's RandomSampler refuses 0 items
    wrappers = [
        DistributedSamplerWrapper(
            base_sampler(case["kind"], n, case["batch"], case["batch_drop"]),
            world,
            rank,
            case["shuffle"],
            case["seed"],
            case["drop_last"],
            case["even"],
        )
        for rank in range(world)
    ]
    per_rank = [list(w) for w in wrappers]
    reference = DistributedSamplerWrapper(
        base_sampler(case["kind"], n, case["batch"], case["batch_drop"]), 1, 0, seed=case["seed"], even_shards=False
    )
    wrapped = list(reference)  # the wrapped sampler's own epoch, seeded as on every rank
    entries = len(wrapped)

    assert [len(entries_) for entries_ in per_rank] == [len(w) for w in wrappers], "__len__ is what is yielded"
    counts = Counter(map(repr, (e for shard in per_rank for e in shard)))
    expected = Counter(map(repr, wrapped))
    if case["drop_last"]:
        assert len({len(s) for s in per_rank}) == 1
        assert sum(map(len, per_rank)) == entries // world * world
        assert all(counts[k] <= expected[k] for k in counts), "dropping never duplicates"
    elif case["even"]:
        assert len({len(s) for s in per_rank}) <= 1
        assert all(counts[k] >= expected[k] for k in expected), "padding never loses"
        assert sum(map(len, per_rank)) == (-(-entries // world) * world if entries else 0)
    else:
        assert counts == expected, "uneven shards: every entry exactly once"
        assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1

    # gather_in_order's inversion: each rank's items back in the wrapped order, padding removed.
    layout = wrappers[0].last_layout
    assert layout is not None
    pieces = [(*layout.rank_items(r), flatten(shard)) for r, shard in enumerate(per_rank)]
    restored = _place([], pieces, layout)
    processed = {i for shard in per_rank for i in flatten(shard)}
    assert restored == [i for i in flatten(wrapped) if i in processed]
    if not case["drop_last"]:
        assert restored == flatten(wrapped), "without drop_last the whole epoch comes back, in order"


def test_layout_is_distributed_samplers_for_plain_datasets() -> None:
    """Wrapping SequentialSampler with shuffle reproduces DistributedSampler exactly, padding included."""
    for drop_last in (False, True):
        for rank in range(3):
            ours = DistributedSamplerWrapper(SequentialSampler(range(11)), 3, rank, True, 5, drop_last)
            theirs = DistributedSampler(range(11), 3, rank, shuffle=True, seed=5, drop_last=drop_last)
            for epoch in range(3):
                theirs.set_epoch(epoch)
                assert list(ours) == list(theirs)


def test_epochs_advance_by_themselves_and_set_epoch_wins() -> None:
    wrapper = DistributedSamplerWrapper(RandomSampler(range(20)), 2, 0)
    first, second = list(wrapper), list(wrapper)
    assert (wrapper.epoch, first != second) == (1, True)
    wrapper.set_epoch(0)
    assert list(wrapper) == first, "an explicit epoch reproduces that epoch"
    wrapper.set_epoch(7)
    list(wrapper)
    list(wrapper)
    assert wrapper.epoch == 8


def test_resuming_part_way_skips_without_touching_the_skipped_items() -> None:
    wrapper = DistributedSamplerWrapper(RandomSampler(range(30)), 3, 1, shuffle=True)
    full = list(wrapper)
    wrapper.load_state_dict({**wrapper.state_dict(), "start": 4})
    assert len(wrapper) == len(full) - 4
    assert list(wrapper) == full[4:]
    assert list(wrapper) != full[4:], "then the next epoch starts"


def test_the_global_rng_is_restored() -> None:
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    expected = (torch.rand(1).item(), random.random(), np.random.rand())
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    list(DistributedSamplerWrapper(GlobalRandomSampler(50), 2, 0, shuffle=True))
    list(DistributedSamplerWrapper(RandomSampler(range(50)), 2, 0))
    assert (torch.rand(1).item(), random.random(), np.random.rand()) == expected


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, num_replicas=2\)"):
        DistributedSamplerWrapper(range(4), 2, 2)
    with pytest.raises(TypeError, match="has no __len__"):
        DistributedSamplerWrapper(iter(range(3)), 1, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start=-1"):
        DistributedSamplerWrapper(range(4), 1, 0).set_start(-1)


def test_without_a_process_group_it_is_one_rank() -> None:
    wrapper = DistributedSamplerWrapper(SequentialSampler(range(5)))
    assert (wrapper.num_replicas, wrapper.rank, list(wrapper)) == (1, 0, [0, 1, 2, 3, 4])
    assert isinstance(wrapper, DistributedSampler)


# --- DDPSamplerWrapper (OML) ------------------------------------------------------------------------------


class BalanceSampler(Sampler[list[int]]):
    """OML's ``BalanceSampler`` in miniature: P labels x K samples per batch, drawn from ``np.random``."""

    def __init__(self, labels: list[int], p: int, k: int) -> None:
        self.labels, self.p, self.k = np.asarray(labels), p, k
        self.classes = np.unique(self.labels)
        self.by_class = {int(c): np.flatnonzero(self.labels == c) for c in self.classes}

    def __len__(self) -> int:
        return len(self.labels) // (self.p * self.k)

    def __iter__(self) -> Any:
        for _ in range(len(self)):
            chosen = np.random.permutation(self.classes)[: self.p]
            yield [int(i) for c in chosen for i in np.random.permutation(self.by_class[int(c)])[: self.k]]


def _epochs(wrapper_class: type, user_seed: int, epochs: int, world_size: int, rank: int = 0) -> list[tuple[int, ...]]:
    """Every epoch's batches on ``rank`` of ``world_size``, in a process seeded with ``user_seed``."""
    np.random.seed(user_seed)  # what seed_everything(user_seed) does
    random.seed(user_seed)
    torch.manual_seed(user_seed)
    sampler = BalanceSampler([i % 8 for i in range(64)], 4, 2)
    if wrapper_class is DDPSamplerWrapper:
        wrapper: Any = DDPSamplerWrapper(sampler)
        wrapper.num_replicas, wrapper.rank = world_size, rank
    else:
        wrapper = DistributedSamplerWrapper(sampler, world_size, rank, seed=user_seed)
    return [tuple(i for batch in wrapper for i in batch) for _ in range(epochs)]


@pytest.mark.parametrize("wrapper_class", [DDPSamplerWrapper, DistributedSamplerWrapper])
@pytest.mark.parametrize("world_size", [2, 3])
def test_no_epoch_repeats_another_for_any_user_seed(wrapper_class: type, world_size: int) -> None:
    """With seed + epoch in the global RNG, a process seeded with k saw epoch k repeat epoch 0 (OML's
    BalanceSampler draws from np.random); every (seed, epoch) now has an order of its own."""
    runs = {seed: _epochs(wrapper_class, seed, 30, world_size) for seed in range(51)}
    everything = [order for orders in runs.values() for order in orders]
    assert len(set(everything)) == len(everything) == 51 * 30, "no two epochs equal, within or across runs"
    assert _epochs(wrapper_class, 7, 30, world_size) == runs[7], "the same user seed, the same epochs"
    other_ranks = [_epochs(wrapper_class, 7, 30, world_size, rank) for rank in range(1, world_size)]
    one_rank = _epochs(wrapper_class, 7, 30, 1)
    for epoch in range(30):  # the ranks' shards of an epoch are the one-rank epoch dealt out (8 batches: W=2 even)
        shards = [runs[7][epoch], *(shard[epoch] for shard in other_ranks)]
        if world_size == 2:
            assert sorted(i for shard in shards for i in shard) == sorted(one_rank[epoch])


def test_a_resumed_ddp_sampler_wrapper_keeps_its_base_seed_and_epoch() -> None:
    torch.manual_seed(3)
    wrapper = DDPSamplerWrapper(RandomSampler(range(10)))
    first, second = list(wrapper), list(wrapper)
    state = {**wrapper.state_dict(), "epoch": 1}
    resumed = DDPSamplerWrapper(RandomSampler(range(10)))
    resumed.load_state_dict(state)
    torch.manual_seed(99)  # the resumed process's global RNG does not matter any more
    assert (list(resumed), list(resumed)) == (second, list(wrapper))
    assert first != second


class EpochAwareSampler(Sampler[int]):
    """A sampler that reshuffles itself per epoch through ``set_epoch``, as many do."""

    def __init__(self, n: int) -> None:
        self.n, self.epochs_seen = n, []  # type: ignore[var-annotated]

    def set_epoch(self, epoch: int) -> None:
        self.epochs_seen.append(epoch)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        shift = self.epochs_seen[-1] if self.epochs_seen else 0
        return iter([(i + shift) % self.n for i in range(self.n)])


def test_set_epoch_reaches_the_wrapped_sampler() -> None:
    """Lightning 2.6's wrapper forwards set_epoch; samplers that reshuffle themselves per epoch rely on it."""
    inner = EpochAwareSampler(4)
    wrapper = DistributedSamplerWrapper(inner, 1, 0)
    wrapper.set_epoch(5)
    assert inner.epochs_seen[-1] == 5, "at once, as Lightning's"
    assert list(wrapper) == [1, 2, 3, 0]
    assert list(wrapper) == [2, 3, 0, 1], "an epoch that advances by itself reaches it too"
    assert inner.epochs_seen[-1] == 6


def test_a_deterministic_sampler_draws_no_base_seed() -> None:
    """No randomness to seed: the global RNG is not consumed and no broadcast would run."""
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    wrapper = DDPSamplerWrapper(BatchSampler(SequentialSampler(range(5)), 2, False), shuffle_samples_between_gpus=False)
    assert list(wrapper) == [[0, 1], [2, 3], [4]]
    assert wrapper.base_seed is None
    assert torch.equal(torch.rand(1), expected)


# --- an epoch resumed part-way on another number of ranks ---------------------------------------

resizes = st.fixed_dictionaries(
    {
        "n": st.integers(1, 60),
        "kind": st.sampled_from(["sequential", "random", "seeded", "custom", "global", "pk"]),
        "batch": st.none() | st.integers(1, 5),
        "shuffle": st.booleans(),
        "seed": st.integers(0, 1000),
        "worlds": st.sampled_from([(3, 2), (2, 3)]),
        "done": st.integers(0, 25),
        "tail": st.sampled_from(["uneven", "pad"]),
        "oml": st.booleans(),
    }
)


def _resizable(case: dict[str, Any], world_size: int, rank: int) -> DistributedSamplerWrapper:
    """A wrapper of the case's sampler on ``rank`` of ``world_size``."""
    n = case["n"]
    if case["kind"] == "pk":  # P x K batches drawn from np.random, as OML's BalanceSampler
        sampler: Any = BalanceSampler([i % 4 for i in range(max(n, 8))], 2, 2)
    else:
        sampler = base_sampler(case["kind"], n, case["batch"], False)
    wrapper: DistributedSamplerWrapper
    if case["oml"]:
        wrapper = DDPSamplerWrapper(sampler, shuffle_samples_between_gpus=case["shuffle"])
        wrapper.num_replicas, wrapper.rank = world_size, rank
    else:
        wrapper = DistributedSamplerWrapper(sampler, world_size, rank, case["shuffle"], case["seed"])
    wrapper.even_shards = case["tail"] == "pad"
    return wrapper


@settings(max_examples=300, deadline=None)
@given(resizes)
def test_a_half_done_epoch_resumes_on_another_number_of_ranks_with_what_is_left(case: dict[str, Any]) -> None:
    """W ranks did k entries each (position k * W of the epoch's global order); W' ranks go on from there.

    For every kind of sampler and batch sampler, both wrappers and both tails:
    with the uneven tail (elastic training) every entry of the epoch is used
    exactly once over both parts; with padding, nothing is lost and the W'
    ranks get equal shards.
    """
    before, after = case["worlds"]
    first = [_resizable(case, before, rank) for rank in range(before)]
    shards = []
    for wrapper in first:
        torch.manual_seed(case["seed"])  # every rank's process seeded alike (OML's wrapper draws its base seed)
        shards.append(list(wrapper))
    done = min(case["done"], *map(len, shards))  # the ranks step together
    state = {**first[0].state_dict(), "position": done * before}
    second = [_resizable(case, after, rank) for rank in range(after)]
    for wrapper in second:
        wrapper.load_state_dict(state)
    lengths = [len(wrapper) for wrapper in second]
    rest = [list(wrapper) for wrapper in second]
    assert [len(part) for part in rest] == lengths, "__len__ is what is left"
    whole = _resizable(case, 1, 0)
    whole.load_state_dict(first[0].state_dict())
    whole.even_shards = False
    epoch = Counter(map(repr, whole))
    used = Counter(map(repr, [e for shard in shards for e in shard[:done]] + [e for part in rest for e in part]))
    if case["tail"] == "uneven":
        assert used == epoch, "every entry exactly once"
        assert max(map(len, rest)) - min(map(len, rest)) <= 1
    else:
        assert all(used[key] >= count for key, count in epoch.items()), "nothing lost"
        assert len({len(part) for part in rest}) == 1
        assert sum(map(len, rest)) - max(0, sum(epoch.values()) - done * before) < after, "fewer pads than ranks"


def test_a_position_counts_entries_of_all_ranks_together() -> None:
    """Position p of the global order goes to rank p % W (from where the epoch resumed)."""
    ranks = [DistributedSamplerWrapper(SequentialSampler(range(10)), 3, rank, even_shards=False) for rank in range(3)]
    for wrapper in ranks:
        wrapper.set_position(4)
    assert [list(wrapper) for wrapper in ranks] == [[4, 7], [5, 8], [6, 9]]
    with pytest.raises(ValueError, match="position=-1 must be >= 0"):
        ranks[0].set_position(-1)
