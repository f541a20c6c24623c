"""A run's checkpoints: what one holds (captured on every rank), writing it (at once, or in rank 0's background),
resuming from one, and taking a healthy replica group's state (private)."""

from __future__ import annotations

import logging
import secrets
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from tqdm import tqdm

from ddpkit.checkpoint import CHECKPOINT_FILE, sharded_name
from ddpkit.process_group import collective_device, get_rank, get_world_size, is_distributed
from ddpkit.training._async_save import AsyncWrites
from ddpkit.training._driver import Budget, StepDriver
from ddpkit.training._messages import resume_line
from ddpkit.training._state import TrainState
from ddpkit.training._steps import TrainingEpochs
from ddpkit.training._trains import Trains

__all__ = ["RunCheckpoints", "check_shared"]

log = logging.getLogger("ddpkit.training._run")  # the run's own lines, under one name


class RunCheckpoints:
    """The checkpoint half of :class:`~ddpkit.training._run.TrainingRun` (which it is a base of)."""

    loop: Trains
    _driver: StepDriver | None
    _writes: AsyncWrites

    @property
    def epochs(self) -> TrainingEpochs:
        raise NotImplementedError

    def _save_checkpoint(self, position: int) -> None:
        """Write a :class:`~ddpkit.training.TrainState` after ``position`` entries of this epoch (every rank); with
        ``checkpoint_async``, a whole one in rank 0's background once the last such write ended."""
        directory = self.loop.checkpoint_dir
        assert directory is not None
        if self.loop.checkpoint_async:
            self._writes.finish()  # one write at a time: the copy of this one waits until the last one is on disk
            state = self.capture(position, directory=directory, asynchronous=True)
            self._writes.start(state, directory / CHECKPOINT_FILE, self.loop.plugin.take_pending_write(),
                               later=_stepped_tensors(self.loop.model, self.loop.optimizer))  # fmt: skip
        else:
            self.capture(position, directory=directory).write(directory / CHECKPOINT_FILE)

    def capture(self, position: int, driver: StepDriver | None = None, directory: Path | None = None,
                asynchronous: bool = False) -> TrainState:  # fmt: skip
        """The run after ``position`` entries of this epoch: a checkpoint's content, and what a fault-tolerant
        replica group hands a recovering peer (every rank calls it; ``driver``: the run's, by default the one
        training now). What ``driver.gathered`` costs: DDP's gather every rank's random state and sum their
        losses; a replica group's, nothing. A sharded model's weights and optimizer state are written to a
        directory in ``directory`` (a checkpoint's), which the state names; without ``directory`` the state is
        made in memory (a plugin that only writes raises ``ValueError``)."""
        loop, driver = self.loop, driver if driver is not None else self._driver
        assert driver is not None, "capture() while it trains, or with its driver"
        rngs, sums = driver.gathered(position)
        name = sharded_name(loop.state.epoch, loop.state.global_step, position)
        weights, optimizer, sharded = loop.plugin.checkpoint_state(
            loop.model, loop.optimizer, directory, name, asynchronous=asynchronous,
        )  # fmt: skip
        return TrainState.capture(
            loop.state, position, self.epochs, model=weights, optimizer=optimizer,
            callbacks=loop.callbacks_handler.state_dicts(), seed=loop.seed, recipe=loop.recipe.state_dict(),
            rngs=rngs, epoch_sums=sums, sharded=sharded,
        )  # fmt: skip

    def resume(self, budget: Budget) -> bool:
        """Go on from the checkpoint in the loop's ``checkpoint_dir``, if there is one (every rank; rank 0 says
        where, with fault tolerance every group's); whether there was."""
        directory = self.loop.checkpoint_dir
        if directory is not None and is_distributed():
            check_shared(directory)  # else ranks that cannot see the checkpoint would start over: a split job
        path = directory / CHECKPOINT_FILE if directory is not None else None
        if path is None or not path.exists():
            return False
        self.restore(TrainState.load(path, map_location=self.loop.device), directory)
        if get_rank() == 0:
            line = resume_line(self.loop.state, directory, budget)
            tqdm.write(f"{line}\n", end="")  # one write: other groups' lines may share the stream
            log.info(line)
        return True

    def restore(self, saved: TrainState, directory: Path | None = None) -> None:
        """Put the run where ``saved`` was (a checkpoint in ``directory``, or a healthy replica group's state;
        every rank)."""
        loop = self.loop
        sharded = directory / saved.sharded if directory is not None and saved.sharded is not None else None
        if saved.sharded is not None and sharded is None:
            raise ValueError(f"the state's weights are in the sharded checkpoint {saved.sharded!r}: give its directory")
        loop.plugin.load_checkpoint_state(loop.model, loop.optimizer, saved.model, saved.optimizer, sharded)
        loop.callbacks_handler.load_state_dicts(saved.callbacks)
        loop.recipe.load_state_dict(saved.recipe)
        saved.restore(loop.state, self.epochs, keeps_steps=loop.global_batch is not None)

    def take_over(self, saved: TrainState) -> int:
        """Put the run where ``saved`` was and begin its epoch there (a fault-tolerant group taking a healthy
        peer's state in a step's commit); the position the epoch goes on from."""
        self.restore(saved)
        return self.loop.state.begin_epoch()


def check_shared(directory: Path) -> None:
    """Refuse, on every rank at once, a ``checkpoint_dir`` that some rank does not see as rank 0 does (a directory
    on each node's own disk): rank 0's checkpoints would be invisible there, and a resumed run would go on from
    one on some ranks and start over on others. One file, two collectives (every rank calls it).

    Raises:
        ValueError: the ranks that do not see rank 0's file in ``directory``, by rank and host, and the fix.
    """
    token = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=collective_device())  # not torch's RNG
    dist.broadcast(token, src=0)  # rank 0's
    marker = directory / f".ddpkit-shared-{int(token[0]):x}"
    if get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        marker.write_text(socket.gethostname())
    dist.barrier()
    seen = marker.exists()
    seen_by = torch.zeros(get_world_size(), dtype=torch.int64, device=collective_device())
    seen_by[get_rank()] = int(seen)
    dist.all_reduce(seen_by)  # each rank's, in its slot
    if get_rank() == 0:
        marker.unlink(missing_ok=True)
    blind = [rank for rank, saw in enumerate(seen_by.tolist()) if not saw]
    if blind:
        raise ValueError(
            f"checkpoint_dir={str(directory)!r} is not the same directory on every rank: rank(s) {blind} do not see a "
            f"file rank 0 wrote there (this is rank {get_rank()} on {socket.gethostname()}). Checkpoints need a "
            "directory that every node sees, or a run resumed from one would go on on some ranks and start over on "
            "others: put checkpoint_dir on a shared file system (NFS, Lustre, a mounted bucket)"
        )


def _stepped_tensors(model: nn.Module, optimizer: Optimizer) -> set[int]:
    """The ``data_ptr`` of each plain CPU tensor that only an optimizer step changes: ``model``'s parameters and
    ``optimizer``'s state (an asynchronous checkpoint copies them while the next step's batches run)."""
    tensors = [*model.parameters(), *(v for state in optimizer.state.values() for v in state.values())]
    return {t.data_ptr() for t in tensors if type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu"}
