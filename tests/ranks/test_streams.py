"""Streams under DDP: split over ranks x DataLoader workers, the three ends, ordered gather, resume, TrainLoop.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_streams.py.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ddpkit import (
    Callback,
    ShardedStream,
    StreamDataLoader,
    TrainLoop,
    gather_stream_in_order,
    patch_dataloader_to_ddp,
)
from ddpkit.examples.digits import DigitsStream, digits_datasets
from ddpkit.testing import run_parallel
from tests.builders import digits_model
from tests.helpers import SETTLED_FORK
from tests.support.streams import Numbers, _regression, _Sample

LENGTHS = (24, 23, 5)  # divides by ranks x workers x batch; does not; fewer items than some ranks x workers
SHARDS = (None, 4, 6)  # no shards; shards that 2 ranks x 1-2 workers split; shards only 3 x 2 split
#: DataLoader workers forked: the pool's workers are spawned, and so would theirs be (seconds each).
_FORK = SETTLED_FORK


def _epoch(length: int, shards: int | None, workers: int, ends: str, batch_size: int = 2) -> dict[str, Any]:
    loader = StreamDataLoader(
        Numbers(length, shards),
        batch_size=batch_size,
        num_workers=workers,
        ends=ends,
        multiprocessing_context=_FORK if workers else None,
    )
    real, padding, batches = [], 0, 0
    for tagged in loader.iter_tagged():
        batches += 1
        if tagged.padding:
            padding += 1
        else:
            real += tagged.batch.tolist()
            keys = tagged.keys.tolist()
            # the key names the item: its shard and offset locate its number in the stream
            for (shard, offset, index), number in zip(keys, tagged.batch.tolist(), strict=True):
                assert index in (-1, number)
                if shards is not None:
                    assert number == shard * -(-length // shards) + offset
    return {"real": real, "padding": padding, "batches": batches, "split": loader.stream.split_for(workers)}


def _every_case() -> list[dict[str, Any]]:
    cases = itertools.product(LENGTHS, SHARDS, (0, 1, 2), ("even", "drop", "join"))
    return [{"case": case, **_epoch(*case)} for case in cases]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_item_is_seen_once_per_epoch_for_every_end_split_and_worker_count(world_size: int) -> None:
    ranks = run_parallel(_every_case, world_size=world_size, timeout=120)
    for results in zip(*ranks, strict=True):
        (length, shards, workers, ends), splits = results[0]["case"], {r["split"] for r in results}
        stream = list(range(length))
        real = sorted(item for r in results for item in r["real"])
        batches = [r["batches"] for r in results]
        assert len(splits) == 1, results
        if ends == "join":  # each rank its own share, nothing repeated
            assert real == stream, results
            assert all(r["padding"] == 0 for r in results)
        elif ends == "even":  # the same number of batches everywhere; padding removed, the stream exactly
            assert real == stream, results
            assert len(set(batches)) == 1, results
        else:  # drop: the same number of batches, no item twice, nothing padded
            assert len(set(batches)) == 1, results
            assert all(r["padding"] == 0 for r in results), results
            assert len(set(real)) == len(real), results
            assert set(real) <= set(stream), results
        if shards is not None and shards % (world_size * max(workers, 1)) == 0:
            assert splits == {"shard"}
        else:
            assert splits == {"example"}


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("shards", SHARDS)
def test_a_sharded_stream_alone_splits_over_explicit_ranks_and_workers(
    world_size: int, workers: int, shards: int | None
) -> None:
    seen: list[int] = []
    for rank in range(world_size):
        stream = ShardedStream(Numbers(23, shards), world_size, rank)
        for batch in DataLoader(stream, batch_size=3, num_workers=workers):
            seen += batch.tolist()
    assert sorted(seen) == list(range(23))


def _read(loader: StreamDataLoader) -> list[int]:
    return [n for batch in loader for n in batch.tolist()]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_stream_built_before_the_process_group_is_split_by_the_group(workers: int) -> None:
    """As TrainLoop.fit_distributed pickles loaders built in the caller: the split is decided when read."""
    fork = _FORK if workers else None
    loader = StreamDataLoader(
        ShardedStream(Numbers(20)), batch_size=2, num_workers=workers, multiprocessing_context=fork
    )
    rank0, rank1 = run_parallel(_read, loader)
    assert sorted(rank0 + rank1) == list(range(20))
    assert len(rank0) == len(rank1) == 10


def _join_in_train_loop(ends: str) -> dict[str, Any]:
    model = _regression()
    loader = StreamDataLoader(_Sample(), batch_size=8, ends=ends)
    loop = TrainLoop(
        model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        criterion=nn.MSELoss(), progress=False,
    )  # fmt: skip
    loop.fit(2)
    return {
        "items": sum(count for _, count in loop.train_loader.progress.state()[-1][1]),
        "steps": loop.global_step,
        "weights": [p.detach().clone() for p in model.parameters()],
        "loss": loop.history["train_loss"],
    }


def test_join_trains_ranks_with_uneven_step_counts_without_hanging_and_ends_with_equal_parameters() -> None:
    rank0, rank1 = run_parallel(_join_in_train_loop, "join", timeout=10)  # a hang fails within seconds
    assert (rank0["items"], rank1["items"]) == (40, 8)  # 5 batches against 1: nothing dropped or repeated
    assert rank0["steps"] == rank1["steps"] == 10
    for a, b in zip(rank0["weights"], rank1["weights"], strict=True):
        assert torch.equal(a, b)
    even0, _ = run_parallel(_join_in_train_loop, "even", timeout=20)  # padding trains on rank 1's batch 5 times
    assert even0["loss"] != rank0["loss"]


def _own_loop_with_torch_join() -> dict[str, Any]:
    model = DistributedDataParallel(_regression())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = 0
    with Join([model]):
        for features, target in StreamDataLoader(_Sample(), batch_size=8, ends="join"):
            nn.functional.mse_loss(model(features), target).backward()
            optimizer.step()
            optimizer.zero_grad()
            batches += 1
    return {"batches": batches, "weights": [p.detach().clone() for p in model.parameters()]}


def test_ends_join_in_a_loop_of_ones_own_runs_under_torch_join() -> None:
    rank0, rank1 = run_parallel(_own_loop_with_torch_join, timeout=10)
    assert (rank0["batches"], rank1["batches"]) == (5, 1)
    for a, b in zip(rank0["weights"], rank1["weights"], strict=True):  # Join broadcasts the last joiner's model
        assert torch.equal(a, b)


def _gathered(padded: bool) -> list[float]:
    loader = StreamDataLoader(Numbers(11, 3), batch_size=2, ends="even" if padded else "join")
    results, keys = [], []
    for tagged in loader.iter_tagged():
        results.append(tagged.batch.double() * 10)
        keys.append(tagged.keys)
    gathered: torch.Tensor = gather_stream_in_order(torch.cat(results), torch.cat(keys))
    assert gather_stream_in_order([float(v) for v in torch.cat(results)], torch.cat(keys)) == gathered.tolist()
    return gathered.tolist()


@pytest.mark.parametrize("padded", [False, True])
def test_gather_stream_in_order_gives_each_item_once_in_stream_order(padded: bool) -> None:
    for result in run_parallel(_gathered, padded, world_size=3):
        assert result == [10.0 * n for n in range(11)]


def _bad_keys() -> str:
    keys = torch.zeros(3 if dist.get_rank() == 1 else 2, 3, dtype=torch.int64)
    try:
        gather_stream_in_order(torch.zeros(2), keys)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_gather_stream_in_order_refuses_mismatched_keys_on_every_rank() -> None:
    for message in run_parallel(_bad_keys):
        assert "rank 1 passed 2 results and keys of shape (3, 3)" in message


def _cannot_pad() -> str:
    loader = StreamDataLoader(Numbers(1), batch_size=2, ends="even")
    try:
        list(loader)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_even_ends_with_a_rank_that_has_nothing_to_pad_with_raise_on_every_rank() -> None:
    for message in run_parallel(_cannot_pad):
        assert "a rank got no batch of this stream to pad with" in message


def _patched() -> dict[str, Any]:
    original = DataLoader(
        Numbers(20), batch_size=3, num_workers=1, collate_fn=_as_list, persistent_workers=True,
        multiprocessing_context=_FORK,
    )  # fmt: skip
    patched = patch_dataloader_to_ddp(original)
    assert isinstance(patched, StreamDataLoader)
    return {
        "epochs": [list(patched), list(patched)],
        "kept": (patched.num_workers, patched.persistent_workers, patched.batch_size, patched.ends),
    }


def _as_list(items: list[int]) -> list[int]:
    return list(items)


def test_patch_dataloader_to_ddp_splits_a_stream_and_keeps_the_loaders_arguments() -> None:
    rank0, rank1 = run_parallel(_patched)
    assert rank0["kept"] == (1, True, 3, "even")
    for epoch in (0, 1):
        items = [n for batch in rank0["epochs"][epoch] + rank1["epochs"][epoch] for n in batch]
        assert sorted(items) == list(range(20))  # 10 each: no padding needed
        assert len(rank0["epochs"][epoch]) == len(rank1["epochs"][epoch]) == 4


class _Record(Callback):
    """The numbers of the samples each optimizer step trained on; stops (every rank) after ``stop`` steps."""

    def __init__(self, stop: int | None) -> None:
        self.stop, self.steps = stop, {}
        self.batch: list[int] = []

    def on_batch_end(self, train_loop: Any) -> None:
        self.steps[train_loop.global_step] = list(self.batch)
        if train_loop.global_step == self.stop:
            raise KeyboardInterrupt


class _RecordingLoop(TrainLoop):
    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        self.recorder.batch = batch[0][:, 0].long().tolist()
        return super().training_step(model, batch)


def _resumable(directory: str, stop: int | None, workers: int) -> dict[str, Any]:
    model = _regression()
    fork = _FORK if workers else None
    loop = _RecordingLoop(
        model, DataLoader(_Sample((32, 32)), batch_size=4, num_workers=workers, multiprocessing_context=fork),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), criterion=nn.MSELoss(),
        checkpoint_dir=directory, checkpoint_every=3, progress=False,
    )  # fmt: skip
    loop.recorder = _Record(stop)
    with contextlib.suppress(KeyboardInterrupt):
        loop.fit(1, callbacks=[loop.recorder])
    return {"steps": loop.recorder.steps, "weights": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_resumed_mid_stream_neither_replays_nor_skips_an_item(tmp_path: Path, workers: int) -> None:
    first = run_parallel(_resumable, str(tmp_path / "run"), 5, workers, timeout=60)
    second = run_parallel(_resumable, str(tmp_path / "run"), None, workers, timeout=60)
    trained = Counter()
    for rank in range(2):
        trained.update(n for step, ns in first[rank]["steps"].items() if step <= 3 for n in ns)  # checkpoint at 3
        assert min(second[rank]["steps"]) == 4
        trained.update(n for ns in second[rank]["steps"].values() for n in ns)
    assert trained == Counter(range(64))  # split by shard (no workers) or by example (2 ranks x 2 workers)...
    whole = run_parallel(_resumable, str(tmp_path / "whole"), None, workers, timeout=60)
    if workers == 0:  # ...and with the workers' order as it was, the resumed run is the uninterrupted one
        for a, b in zip(whole[0]["weights"], second[0]["weights"], strict=True):
            assert torch.equal(a, b)


def _digits(stream: bool) -> float:
    model = digits_model(64)
    if stream:
        train, validation = DigitsStream(), DigitsStream("validation")
    else:
        train, validation = digits_datasets()  # type: ignore[assignment]
    loop = TrainLoop(
        model, DataLoader(train, batch_size=32), DataLoader(validation, batch_size=100),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), progress=False,
    )  # fmt: skip
    return loop.fit(10)["validation_accuracy"][-1]


def test_train_loop_on_streamed_digits_reaches_the_map_datasets_accuracy() -> None:
    streamed = run_parallel(_digits, True, timeout=120)
    mapped = run_parallel(_digits, False, timeout=120)
    assert streamed[0] == streamed[1]
    assert mapped[0] == mapped[1]
    assert mapped[0] > 0.95
    assert abs(streamed[0] - mapped[0]) <= 0.02, (streamed, mapped)
