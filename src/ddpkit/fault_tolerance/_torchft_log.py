"""torchft's manager log, one line per event, and an error's first line for ddpkit's own (private)."""

from __future__ import annotations

import logging
import re

import torch

from ddpkit.errors import DDPKitError

__all__ = ["QuietTorchft", "first_line", "quiet_torchft"]

log = logging.getLogger("ddpkit.fault_tolerance._replica")  # the replica group's log, where its steps are said


class QuietTorchft(logging.Filter):
    """torchft's manager log, one line per event: a failed step's exception (torchft logs it with its
    traceback, in every group, at every failure) goes to ddpkit's log at DEBUG, since the replica group's
    ``commit`` keeps its first line (:func:`first_line`) for the group's own "step N was not committed" warning,
    except ddpkit's own errors (a member of the quorum that cannot prove the job secret, named), which keep their
    line without the traceback; and, on a torch without NCCL (a CPU build), the "Unable to reset NCCL flight
    recorder" warning that every group prints at every new quorum is dropped: there is no flight recorder to
    reset."""

    def __init__(self, nccl: bool) -> None:
        super().__init__()
        self.nccl = nccl

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.levelno >= logging.ERROR:
            log.debug("torchft: %s", record.getMessage(), exc_info=record.exc_info)
            if not isinstance(record.exc_info[1], DDPKitError):
                return False
            record.exc_info = record.exc_text = None  # who failed the proof, in one line
        return self.nccl or "Unable to reset NCCL flight recorder" not in record.getMessage()


def first_line(error: BaseException) -> str:
    """``Type: message``, its first line without gloo's source location, at most 200 characters."""
    message = re.sub(r"\[[^\]\s]+\.(?:cc|cpp|h):\d+\] ", "", str(error).strip().partition("\n")[0])
    text = f"{type(error).__name__}: {message}"
    return text if len(text) <= 200 else text[:197] + "..."


def quiet_torchft() -> None:
    """Install :class:`QuietTorchft` on torchft's manager logger, once."""
    logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, QuietTorchft) for f in logger.filters):
        logger.addFilter(QuietTorchft(torch.distributed.is_nccl_available()))
