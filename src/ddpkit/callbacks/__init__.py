"""Callbacks of ``TrainLoop``: the protocol, aitoolbox's sampler epochs, loggers, early stopping, best weights."""

from ddpkit.callbacks.base import Callback, CallbacksHandler, DistributedSamplerSetEpoch, Event, TrainLoopView
from ddpkit.callbacks.loggers import CSVLogger, TensorBoardLogger
from ddpkit.callbacks.monitors import EarlyStopping, ModelCheckpoint

__all__ = [
    "CSVLogger",
    "Callback",
    "CallbacksHandler",
    "DistributedSamplerSetEpoch",
    "EarlyStopping",
    "Event",
    "ModelCheckpoint",
    "TensorBoardLogger",
    "TrainLoopView",
]
