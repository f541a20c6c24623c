"""``TrainLoop``: single-process training that becomes DDP by changing one call (after aitoolbox's ``TrainLoop``).

``fit`` trains in this process (as DDP when a process group exists); ``fit_distributed`` (``_new_processes``)
launches ``num_processes`` workers that each run ``fit``. The same code path serves both: loaders are sharded by
:class:`~ddpkit.DDPHandler` (over one rank when alone), so the data order is the same either way, and W ranks with
batch B step through exactly the batches of one process with batch W x B. Validation metrics are computed on every
sample exactly once (:func:`~ddpkit.gather_in_order`), so they equal the single-process numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit.callbacks import Callback, CallbacksHandler
from ddpkit.ddp_handler import DDPHandler
from ddpkit.ddp_plugin import DDPPlugin
from ddpkit.fault_tolerance import TorchFT, torchft_settings
from ddpkit.parallel_plugin import ParallelPlugin
from ddpkit.plotting import plot_history
from ddpkit.process_group import ensure_dist_connection, rank_device
from ddpkit.training._ddp_steps import DDPSteps
from ddpkit.training._default_steps import DefaultSteps, MetricSet, StepMethods
from ddpkit.training._driver import Budget, StepDriver
from ddpkit.training._fault_tolerant import FaultTolerantSteps
from ddpkit.training._new_processes import RunsElsewhere
from ddpkit.training._preemption import PreemptionHandler
from ddpkit.training._recipe import Interval, Precision, Recipe, Scheduler, SchedulerFactory
from ddpkit.training._run import TrainingRun
from ddpkit.training._state import RunField, RunState
from ddpkit.training._steps import GlobalBatch

__all__ = ["TrainLoop"]

log = logging.getLogger(__name__)


class TrainLoop(StepMethods, RunsElsewhere):
    """Train, validate and test a model, in one process or as DDP (the ``TrainLoop`` of aitoolbox's ``DDPHandler``).

    Args:
        model: the ``nn.Module``.
        train_loader: training data; its sampler (or batch sampler) is sharded across ranks.
        validation_loader: evaluated after each epoch (optional).
        test_loader: for :meth:`evaluate` (optional).
        optimizer: default ``torch.optim.Adam(model.parameters())`` (learning rate 1e-3).
        criterion: the loss of the default :meth:`training_step` when the model
            computes none of its own; default ``nn.CrossEntropyLoss()`` (per-token
            scores ``(N, T, V)`` with labels ``(N, T)`` taken as ``N * T``
            samples, labels ``-100`` left out).
        device: default ``cuda:<local rank>`` when CUDA is available, else CPU.
        plugin: the :class:`~ddpkit.DDPPlugin` that wraps the model (default ``DDPPlugin()``), or an
            :class:`~ddpkit.FSDPPlugin` that shards it (weights, gradients and optimizer state ``1/W`` per rank).
        checkpoint_dir: where to write checkpoints (``last.pt``, atomically) and
            resume from: a run started with a directory that holds one continues at
            the exact batch, with model, optimizer, sampler epochs and every rank's
            RNG state restored.
        checkpoint_every: also checkpoint every this many optimizer steps (besides
            each epoch's end and where ``fit`` stops inside an epoch).
        checkpoint_async: write each checkpoint while training goes on (default
            ``False``; Lightning's ``AsyncCheckpointIO``): the state is copied
            off the live tensors (into pinned memory from a GPU) and rank 0
            writes the copy in a thread, atomically as always, so ``last.pt``
            names a checkpoint only once it is whole and a crash mid-write
            leaves the one before. One write at a time: a checkpoint waits for
            the last one to be on disk; ``fit`` returns once the last is, and a
            failed write raises on every rank at the next checkpoint or at the
            end. The copy's buffers are kept for the next checkpoint (as much
            CPU memory as the state). A sharded model's shards are written by
            torch's ``torch.distributed.checkpoint.async_save`` (copied to the CPU,
            written by a thread, its collectives on a gloo group of its own), its
            directory and ``last.pt`` put in place once every rank has written.
        evaluate_every: also evaluate the validation split after every this many
            optimizer steps (besides each epoch's end; Lightning's integer
            ``val_check_interval``, Hugging Face's ``eval_steps``), exactly as
            at an epoch's end (every item once, in order, the same on every
            rank): ``history["eval_step"]`` and ``history["eval_<name>"]`` hold
            each one, and rank 0 prints a line. An epoch that ends at such a
            step reuses its metrics. Needs a ``validation_loader``.
        seed: seeds the data order: each epoch's from ``seed`` and the epoch
            (the position shuffle as ``DistributedSampler(seed=seed)``).
        progress: show a progress bar on rank 0.
        global_batch_size: items per optimizer step over all ranks, kept on any
            number of ranks (default ``None``: ``W`` x batch x ``grad_accumulation``).
            Each rank accumulates ``global_batch_size / (W * batch)`` batches (a
            world size that cannot is refused, naming those that can), every item
            is used once per epoch, and torch's RNG is reseeded before each batch
            from ``seed``, the epoch and the batch's position. A resized run
            (``fit_distributed(nnodes="MIN:MAX")``) then ends where an unresized
            one does, up to rounding, if ``training_step`` returns a mean over
            the batch's items and draws no random numbers (as dropout does).
        requeue: in a SLURM task with a ``checkpoint_dir``, SIGUSR1 (``#SBATCH
            --signal=USR1@90``) or SIGTERM (preemption, ``scancel``) makes every
            rank save a checkpoint within two optimizer steps and stop with
            :class:`~ddpkit.training.Preempted`; with ``requeue=True`` (default
            ``False``) rank 0 first runs ``scontrol requeue $SLURM_JOB_ID``, and
            the requeued job resumes at the exact batch.
        lr_scheduler: a ``torch.optim.lr_scheduler`` scheduler built on
            ``optimizer``, or a callable ``optimizer -> scheduler`` (picklable, a
            module-level function or ``functools.partial``, for
            :meth:`fit_distributed`, whose workers each rebuild it on their
            optimizer). Its state is in the checkpoints; with a
            ``global_batch_size`` a resumed or resized run has the learning rate
            of an uninterrupted run at every step. ``history["lr"]`` holds each
            epoch's last learning rate, ``step_metrics["lr"]`` each step's.
            A step that fp16's scaler skips does not step it.
        lr_scheduler_interval: ``"epoch"`` (default, as Lightning and PyTorch's
            examples: a scheduler written per epoch, such as ``StepLR(step_size=30)``,
            means epochs) or ``"step"`` (after every optimizer step: warm-up,
            ``OneCycleLR``, cosine over steps).
        lr_scheduler_monitor: the ``history`` name ``ReduceLROnPlateau`` steps
            on (default ``"validation_loss"``): the whole split's number, the
            same on every rank (Lightning's ``monitor``).
        precision: ``"32"`` (default), ``"bf16-mixed"`` or ``"16-mixed"``
            (Lightning's names): the forward of training and evaluation under
            ``torch.autocast`` on the model's device type (bf16 runs on CPU
            too); fp16 scales the loss with ``torch.amp.GradScaler`` (its state
            checkpointed) and a step with inf or nan gradients is skipped on
            every rank and counted in ``history["skipped_steps"]``. Weights and
            the optimizer stay float32; evaluation's predictions are gathered as float32.
        gradient_clip_norm: clip the gradients' total 2-norm to this at each
            optimizer step (``torch.nn.utils.clip_grad_norm_``; Lightning's
            ``gradient_clip_val`` with the default ``"norm"`` algorithm).
        gradient_clip_val: clip each gradient element to ``[-v, v]``
            (``clip_grad_value_``; Lightning's ``gradient_clip_algorithm="value"``).
            Either clip acts on the all-reduced gradient at the optimizer step
            only (with accumulation after the last micro-batch, with fp16 after
            unscaling), so DDP still equals one process; the norm before
            clipping is ``step_metrics["grad_norm"]``.
        compile: ``True`` or a dict of ``torch.compile`` arguments to compile the
            model for training: the DDP-wrapped model is compiled, as PyTorch
            recommends (its graph breaks at DDP's buckets). Checkpoints and
            :class:`~ddpkit.ModelCheckpoint` files hold the plain model's
            ``state_dict`` (no ``_orig_mod.`` prefixes); evaluation runs the
            plain model. A backend torch lacks, or inductor on CPU without a C++
            compiler, raises ``RuntimeError`` naming it.
        fault_tolerance: ``None`` (default), ``"torchft"`` or a
            :class:`~ddpkit.fault_tolerance.TorchFT`: this process is one replica
            group of a job on torchft (``pip install torchft==0.2.0``, ddpkit's ``ft`` extra; ``"torchft"``
            reads ``$TORCHFT_LIGHTHOUSE`` and ``$REPLICA_GROUP_ID``). Each optimizer
            step is a quorum of the groups alive: a group that dies or hangs costs
            the others that step (done again with the same items), not a restart,
            and a group started again takes the run's state live from a peer.
            Needs ``global_batch_size``: step ``s`` holds the same items of the
            epoch's order whatever the number of groups (dealt over the step's
            groups, loaded ahead by the loader's workers), so the weights are
            those of a run that lost nothing, up to rounding. Each group evaluates
            the whole split (exact, the same in every group); one writes
            checkpoints. A group is this process, or every rank of this
            process's process group (``ddpkit run --fault-tolerance -n 4
            --group-size 2``: two groups of two ranks; each step's share of a
            group is dealt over its ranks and averaged over them, then over the
            quorum). With ``plugin=FSDPPlugin()`` each group shards the model over
            its own ranks and rank ``r`` of each group averages its gradient shards
            with rank ``r`` of the others (HSDP across replica groups; every group
            needs the same number of ranks). Start the groups with
            :meth:`fit_distributed` or ``ddpkit run --fault-tolerance``.
        tokens_fn: what a token is: a callable that takes a batch (on the
            device, as ``training_step`` gets it) and returns its number of
            tokens, an ``int`` or a tensor (``batch["attention_mask"].sum()``:
            summed on its device, never read back in a step). The epoch line
            then shows tokens/s besides items/s, over every rank, and
            ``history["tokens_per_second"]`` has them (as Lightning's
            ``ThroughputMonitor(length_fn=...)`` and torchtitan's tps). Default
            ``None``: items/s alone.
        metrics: what the default :meth:`predict_step` and
            :meth:`compute_metrics` report. ``"lm"``: a language model's (any
            per-token scores') ``loss`` (the mean negative log-likelihood a
            token, in nats; labels ``-100`` count in nothing), ``perplexity``
            (``exp(loss)``) and ``token_accuracy``, each sequence gathered as 3
            numbers rather than its ``(T, V)`` logits.
            ``"classification"``: ``loss`` (the criterion) and, for scores
            ``(N, C)``, ``accuracy``. Default ``None``: ``"lm"`` when the
            model's prediction is per-token scores ``(N, T, V)`` of integer
            labels ``(N, T)``, else ``"classification"``.

    Raises:
        ValueError: a setting out of range (``checkpoint_every``,
            ``evaluate_every``, ``metrics``, ...), named with the fix.

    Attributes aitoolbox's ``DDPHandler`` uses: ``train_loader``, ``validation_loader``, ``test_loader``,
    ``device``, ``callbacks_handler``, ``ddp_handler`` (a :class:`~ddpkit.DDPHandler` once :meth:`fit` has set up).

    The default steps take a batch ``(inputs, targets)`` (``model(inputs)``) or a
    mapping of the model's keyword arguments (``model(**batch)``, its targets
    under ``"labels"``: transformers' convention), and a model that returns a
    tensor or an output with ``loss`` and ``logits`` (transformers'
    ``ModelOutput``). Override :meth:`training_step`, :meth:`predict_step`,
    :meth:`compute_metrics` or :meth:`batch_to_device` for other batches.
    """

    #: The epoch being trained (0-based).
    epoch = RunField[int]()
    #: Optimizer steps taken in all.
    global_step = RunField[int]()
    #: Per-epoch numbers, ``train_loss``, ``validation_<metric>``, ``items_per_second`` (over every rank) and
    #: ``peak_memory_mib`` (the most any rank held).
    history = RunField[dict[str, list[float]]]()
    #: This rank's (sum of sample losses, samples) in the last optimizer step (float64, shape ``(2,)``), on the
    #: loss's device: reading it (``.tolist()``, ``float(...)``) waits for the device; the loop itself never does.
    step_loss = RunField[torch.Tensor]()
    #: Set by a callback (e.g. :class:`~ddpkit.EarlyStopping`, on every rank) to end ``fit`` after this epoch.
    should_stop = RunField[bool]()
    #: What the last optimizer step measured besides its loss, the same on every rank. ``lr`` with a scheduler,
    #: ``grad_norm`` (before clipping) with clipping, ``replica_groups`` (the groups whose items it averaged) with
    #: fault tolerance. A mapping of floats: a value computed on the device (``grad_norm``) is read back when a
    #: callback first asks for it, not by the step.
    step_metrics = RunField[Mapping[str, float]]()

    def __init__(
        self,
        model: nn.Module,
        train_loader: DataLoader[Any],
        validation_loader: DataLoader[Any] | None = None,
        test_loader: DataLoader[Any] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: nn.Module | None = None,
        *,
        device: torch.device | str | None = None,
        plugin: ParallelPlugin | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int | None = None,
        checkpoint_async: bool = False,
        evaluate_every: int | None = None,
        seed: int = 0,
        progress: bool = True,
        global_batch_size: int | None = None,
        requeue: bool = False,
        lr_scheduler: Scheduler | SchedulerFactory | None = None,
        lr_scheduler_interval: Interval = "epoch",
        lr_scheduler_monitor: str = "validation_loss",
        precision: Precision = "32",
        gradient_clip_norm: float | None = None,
        gradient_clip_val: float | None = None,
        compile: bool | dict[str, Any] = False,
        fault_tolerance: str | TorchFT | None = None,
        tokens_fn: Callable[[Any], int | torch.Tensor] | None = None,
        metrics: MetricSet = None,
    ) -> None:
        if checkpoint_every is not None and checkpoint_every < 1:
            raise ValueError(f"checkpoint_every={checkpoint_every} must be >= 1 optimizer steps (or None)")
        if evaluate_every is not None and evaluate_every < 1:
            raise ValueError(f"evaluate_every={evaluate_every} must be >= 1 optimizer steps (or None)")
        if evaluate_every is not None and validation_loader is None:
            raise ValueError(
                f"evaluate_every={evaluate_every} evaluates the validation split: pass a validation_loader"
            )
        #: The torchft settings this process trains as one replica group with (``None``: plain DDP).
        self.fault_tolerance = torchft_settings(fault_tolerance)
        self.global_batch = GlobalBatch.of(global_batch_size, fault_tolerant=self.fault_tolerance is not None)
        self.model = model
        self.train_loader = train_loader
        self.validation_loader = validation_loader
        self.test_loader = test_loader
        self.optimizer = optimizer if optimizer is not None else torch.optim.Adam(model.parameters())
        self.criterion = criterion if criterion is not None else nn.CrossEntropyLoss()
        #: What the default steps learned of the model (which metrics; how its labels line up).
        self.default_steps = DefaultSteps(criterion is not None, metrics)
        self.device = torch.device(device) if device is not None else rank_device()
        self.plugin = plugin if plugin is not None else DDPPlugin()
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.checkpoint_async = checkpoint_async
        self.evaluate_every = evaluate_every
        self.seed = seed
        self.progress = progress
        self.preemption = PreemptionHandler(requeue)
        #: What counts a batch's tokens (``None``: no tokens/s).
        self.tokens_fn = tokens_fn
        #: The schedule, precision, clipping and compilation of each step.
        self.recipe = Recipe(
            lr_scheduler=lr_scheduler, interval=lr_scheduler_interval, monitor=lr_scheduler_monitor,
            precision=precision, clip_norm=gradient_clip_norm, clip_value=gradient_clip_val, compile=compile,
        )  # fmt: skip
        self.callbacks_handler = CallbacksHandler(self)
        #: Everything that changes while it trains (``epoch``, ``global_step``, ... are its fields).
        self.state = RunState()
        #: A :class:`~ddpkit.DDPHandler` once :meth:`fit` has set up.
        self.ddp_handler: DDPHandler | None = None
        #: The DDP-wrapped model once :meth:`fit` has set up (the model itself in one process).
        self.ddp_model: nn.Module | None = None
        #: Each rank's (with fault tolerance each replica group's, by name) mean time per batch in the last epoch
        #: (ms) for loading and forward, before the step's all-reduce (a fast one waits there). Empty in one process.
        self.step_times: list[float] = []
        self._run = TrainingRun(self)  # how it trains: set-up, epochs, steps, checkpoints

    def __getstate__(self) -> dict[str, Any]:
        return self._run.pickled()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._run = TrainingRun(self)

    # --- training ----------------------------------------------------------------------------------

    def fit(
        self,
        num_epochs: int | None = None,
        grad_accumulation: int = 1,
        callbacks: list[Callback] | None = None,
        *,
        max_steps: int | None = None,
    ) -> dict[str, list[float]]:
        """Train for ``num_epochs`` epochs or ``max_steps`` optimizer steps, whichever comes first (in all, counting
        those a checkpoint already holds), or until a callback sets ``should_stop``.

        In a process that a launcher started as one of several ranks (torchrun,
        ``ddpkit run``, ``srun``, ``mpirun``) it first creates the default
        process group if none exists (:func:`~ddpkit.ensure_dist_connection`);
        a group that exists (inside :meth:`fit_distributed`, or made by
        ``init_process_group``) is used as it is. With a group every rank must
        call it: the model is wrapped in DDP and the loaders are sharded. A
        process alone trains in this process.

        A run that ends inside an epoch (``max_steps``, or ``should_stop`` set in
        ``on_batch_end``) ends after that step's ``on_batch_end``, its evaluation
        (``evaluate_every``) and its checkpoint (with a ``checkpoint_dir``, always
        written there); the rank 0 prints where it stopped and the train loss of the
        epoch's steps so far, and the epoch gets no ``history`` entry yet: a run
        resumed from that checkpoint goes on inside it, to the same result as a run
        never stopped.

        Args:
            num_epochs: the epoch to stop after (``None``: as many as ``max_steps`` takes).
            grad_accumulation: batches per optimizer step; the loss of each is
                divided by it, and the non-final ones skip DDP's all-reduce.
            callbacks: :class:`~ddpkit.Callback` instances to add.
            max_steps: the optimizer step to stop after (Lightning's and Hugging
                Face's ``max_steps``; default ``None``: every step of ``num_epochs``).

        Returns:
            :attr:`history`: per epoch, ``train_loss`` (mean over all ranks' samples)
            and the validation metrics; per ``evaluate_every`` evaluation,
            ``eval_step`` and the metrics as ``eval_<name>``.

        Raises:
            ValueError: neither ``num_epochs`` nor ``max_steps``, either below 1, or
                ``grad_accumulation < 1``; or ``grad_accumulation`` besides
                ``global_batch_size`` (which sets it), or a world size that cannot
                reach ``global_batch_size``.
        """
        if (num_epochs is not None and num_epochs < 1) or grad_accumulation < 1:
            raise ValueError(f"num_epochs={num_epochs} and grad_accumulation={grad_accumulation} must be >= 1")
        budget = Budget(num_epochs, max_steps)
        if self.global_batch is not None:
            self.global_batch.check_no_accumulation(grad_accumulation)
        ensure_dist_connection()  # under torchrun, srun, mpirun...: one job, not N copies
        self.callbacks_handler.register_callbacks(callbacks)
        driver: StepDriver = (  # what differs between DDP and a fault-tolerant replica group: the steps
            FaultTolerantSteps.of(self._run, self.fault_tolerance)
            if self.fault_tolerance is not None
            else DDPSteps(self._run, grad_accumulation)
        )
        self._run.resume(budget)
        return self._run.run_epochs(driver, budget)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's whole weights on the CPU, ``state_dict()``'s names (for export or a one-process copy).

        With a sharded model (:class:`~ddpkit.FSDPPlugin`) every rank must call it (the
        shards are gathered) and rank 0 gets them, the others ``{}``; otherwise every rank
        gets its model's. Through :meth:`fit_distributed` this process's ``model`` holds
        them already.
        """
        return self.plugin.full_state_dict(self.model)

    def plot_history(self, path: str | Path) -> Path:
        """Write a PNG of every curve of :attr:`history` (losses in one panel); its path.

        Raises:
            ImportError: matplotlib is not installed (``pip install matplotlib``, ddpkit's ``plot`` extra).
            ValueError: nothing trained yet.
        """
        return plot_history(self.history, path)

    def evaluate(self, loader: DataLoader[Any] | None = None) -> dict[str, float]:
        """Metrics of ``loader`` (default the validation loader), computed on every sample exactly once.

        Each rank predicts its shard; :func:`~ddpkit.gather_in_order` (for a stream
        :func:`~ddpkit.gather_stream_in_order`) brings the results back in order, without
        duplicates, and :meth:`compute_metrics` sees the whole split: the result equals a
        single-process evaluation and is the same on every rank (which must all call it).

        Raises:
            ValueError: no loader given and no validation loader.
        """
        loader = loader if loader is not None else self.validation_loader
        if loader is None:
            raise ValueError("evaluate() needs a loader: pass one or give the TrainLoop a validation_loader")
        return self.compute_metrics(*self._run.predict_split(loader))
