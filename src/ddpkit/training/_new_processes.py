"""``TrainLoop.fit_distributed``'s work: the loop pickled to new processes (or a scheduler's), each running ``fit``."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from ddpkit._torch_private import NAMES
from ddpkit.callbacks import Callback
from ddpkit.checkpoint import rng_state
from ddpkit.jobs.launch import StartMethod, launch, scheduler_environment, start_forkserver
from ddpkit.training._driver import Budget
from ddpkit.training._launched import Fits, Result, fit_worker
from ddpkit.training._replica_groups import fit_replica_groups
from ddpkit.training._state import RunState

__all__ = ["RunsElsewhere", "fit_elsewhere", "fit_on_new_processes"]


def fit_elsewhere(
    loop: Fits, budget: Budget, num_processes: int, grad_accumulation: int, callbacks: list[Callback] | None,
    *, max_restarts: int, **launch_options: Any,
) -> Result:  # fmt: skip
    """``fit_distributed``'s run: on new processes (:func:`fit_on_new_processes`), or with fault tolerance as
    replica groups (``_replica_groups.fit_replica_groups``); rank 0's (the first group's) weights and run state."""
    settings = loop.fault_tolerance
    if settings is None:
        weights, state = fit_on_new_processes(
            loop, budget, num_processes, grad_accumulation, callbacks, max_restarts=max_restarts, **launch_options
        )
    else:
        weights, state = fit_replica_groups(
            loop, settings, budget, num_processes, callbacks, max_restarts, grad_accumulation=grad_accumulation,
            **launch_options,
        )  # fmt: skip
    state.history = defaultdict(list, state.history)
    return weights, state


def fit_on_new_processes(
    loop: Fits,
    budget: Budget,
    num_processes: int,
    grad_accumulation: int,
    callbacks: list[Callback] | None,
    **launch_options: Any,
) -> Result:
    """Run ``loop.fit`` (a ``TrainLoop``'s) on ``num_processes`` new processes through :func:`~ddpkit.launch`;
    rank 0's weights and run state (history, steps, last step's metrics).

    Every worker starts from this process's random state. Under a scheduler that started the job's processes,
    this process trains as one of its ranks instead. ``launch_options`` are :func:`~ddpkit.launch`'s.
    """
    in_this_process = scheduler_environment() is not None  # srun, mpirun, torchrun: no spawning
    if not in_this_process and launch_options.get("start_method") == "forkserver":
        start_forkserver(NAMES["dynamo"].module)  # DDP's constructor imports it: 2 s per worker otherwise
    results = launch(
        fit_worker, loop, budget, grad_accumulation, callbacks, in_this_process, rng_state(),
        nprocs=None if in_this_process else num_processes, **launch_options,
    )  # fmt: skip
    state: RunState
    state, weights = results[min(results)]
    return weights, state


class RunsElsewhere:
    """``TrainLoop``'s :meth:`fit_distributed` (its base): :meth:`fit` on new processes."""

    if TYPE_CHECKING:  # the loop's (not documented here: the loop documents them)
        model: nn.Module
        state: RunState

    def fit_distributed(
        self,
        num_epochs: int | None = None,
        num_processes: int = 2,
        grad_accumulation: int = 1,
        callbacks: list[Callback] | None = None,
        *,
        max_steps: int | None = None,
        backend: str | None = None,
        max_restarts: int = 0,
        timeout: float | None = None,
        nnodes: int | str = 1,
        rdzv_endpoint: str | None = None,
        rdzv_conf: dict[str, Any] | str | None = None,
        start_method: StartMethod = "spawn",
    ) -> dict[str, list[float]]:
        """Run :meth:`fit` on ``num_processes`` new processes (through :func:`~ddpkit.launch`).

        The train loop (model, loaders, optimizer, callbacks) is pickled to every
        worker, and every worker starts from this process's random state (torch,
        numpy, Python): the run is reproducible. Afterwards this process's
        ``model`` holds the trained weights and :attr:`history` rank 0's
        history. With ``max_restarts`` and a ``checkpoint_dir``, restarted workers
        resume from the last checkpoint (bit-identical to an uninterrupted run).
        Call it under ``if __name__ == "__main__":``. Under a scheduler that
        already started the job's processes (``srun``, ``mpirun``, torchrun)
        nothing is spawned: this process trains as one of its ranks and
        ``num_processes`` is ignored.

        Args:
            num_epochs, grad_accumulation, callbacks, max_steps: as for :meth:`fit`.
            num_processes: worker processes (default 2).
            backend: the process-group backend (default: NCCL on GPUs, else gloo).
            max_restarts: restarts of all workers after a failure or a hang.
            timeout: seconds a rank may wait in one collective before the job
                counts as hung (default 300; ``0``: never), as in :func:`~ddpkit.launch`.
            nnodes, rdzv_endpoint, rdzv_conf: as for :func:`~ddpkit.launch`: call
                it on every node; ``nnodes="MIN:MAX"`` is an elastic job (use a
                ``checkpoint_dir``, ``max_restarts`` for nodes lost, and
                ``global_batch_size`` to keep the steps as the world size changes).
            start_method: as for :func:`~ddpkit.launch` (default ``"spawn"``);
                ``"forkserver"`` also imports ``torch._dynamo`` (which DDP's
                constructor imports) once in the server: workers reach their
                first step about 2 s sooner here.

        With ``fault_tolerance``, the ``num_processes`` processes are replica groups (``group-0``, ...), each
        under an elastic agent of its own that starts it again up to ``max_restarts`` times when it dies while
        the others go on, with a lighthouse in this process on loopback (unless the settings name one); this
        process then holds the weights and run state of the first group that finished. With ``nnodes=N`` and
        ``rdzv_endpoint="HOST:PORT"``, called on every node, each node is one replica group of
        ``num_processes`` ranks (``ddpkit run --fault-tolerance --nnodes N``: the lighthouse at the endpoint,
        served by the node whose address ``HOST`` is; the job secret required), and this process holds its
        group's weights and run state. There ``timeout`` is the settings' ``timeout`` (seconds a step's
        collectives may take before the step fails in every group), ``backend`` can only be ``"gloo"`` and
        ``start_method`` only ``"spawn"``.

        Raises:
            ValueError: a budget :meth:`fit` refuses (before any process starts); with ``fault_tolerance``:
                ``grad_accumulation`` or ``rdzv_conf`` given, ``nnodes`` other
                than a whole number, ``nnodes`` above 1 without ``rdzv_endpoint`` (or an endpoint with one node),
                another ``backend`` or ``start_method``, ``timeout=0``, a scheduler started this process, or no
                job secret on several nodes (the message names each).
            HangError: the job hung (after ``max_restarts`` restarts).
            WorkerFailedError: a worker failed (after ``max_restarts`` restarts).
        """
        loop = cast(Fits, self)  # a TrainLoop, whose base this is
        weights, self.state = fit_elsewhere(
            loop, Budget(num_epochs, max_steps), num_processes, grad_accumulation, callbacks, backend=backend,
            max_restarts=max_restarts,
            timeout=timeout, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf, start_method=start_method,
        )  # fmt: skip
        if weights is not None:  # this node ran rank 0 (or a replica group finished)
            self.model.load_state_dict(weights)
        return dict(self.state.history)
