"""Where a replica group finds its job: the lighthouse, its own id, the quorum's size and timeouts."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ddpkit.environments.replica_group import GROUPS_VARIABLE, LIGHTHOUSE_VARIABLE, REPLICA_ID_VARIABLE
from ddpkit.fault_tolerance._replica import ReplicaGroup


@dataclass(frozen=True)
class TorchFT:
    """Per-step fault tolerance on torchft for ``TrainLoop(fault_tolerance=TorchFT(...))``
    (``fault_tolerance="torchft"`` is ``TorchFT()``: everything from the environment).

    The arguments of torchft's ``torchft.Manager`` that a replica group needs, by their meaning:
    ``lighthouse_addr``, ``replica_id``, ``min_replica_size``, ``timeout`` and ``quorum_timeout`` (seconds
    here, ``timedelta`` there); ddpkit picks the rest (its store, transport and servers on one address).

    Args:
        lighthouse: the lighthouse's address, ``http://HOST:PORT`` (:func:`serve_lighthouse`); default
            ``$TORCHFT_LIGHTHOUSE`` (torchft's variable).
        replica_id: this replica group's name in the quorum, kept when it is started again; default
            ``$REPLICA_GROUP_ID`` (the name in torchft's examples).
        min_replicas: the fewest replica groups a step may commit with (default 1).
        timeout: seconds a step's collectives or a recovery may take before the step fails in every group
            (default 30): a group that hangs longer is dropped from the next quorum.
        quorum_timeout: seconds to wait for a quorum (default 60).
        replica_groups: how many replica groups the job starts: its first step waits, up to ``quorum_timeout``,
            until that many have joined, so that no group trains alone while the others are still starting
            (work that the others would then redo). Default ``$DDPKIT_REPLICA_GROUPS`` (which
            ``ddpkit run --fault-tolerance`` and ``fit_distributed`` set), else no wait.
        member_timeout: seconds a quorum's set-up waits for its members (default 3): a group that died
            after it asked for the quorum costs the others this before they go on without it (at least the
            lighthouse's heartbeat timeout, 1 s by default, plus a margin for a loaded machine).

    Raises:
        ValueError: ``min_replicas`` or ``replica_groups`` below 1, or a timeout that is not a positive number.
    """

    lighthouse: str | None = None
    replica_id: str | None = None
    min_replicas: int = 1
    timeout: float = 30.0
    quorum_timeout: float = 60.0
    replica_groups: int | None = None
    member_timeout: float = 3.0

    def __post_init__(self) -> None:
        for name in ("min_replicas", "replica_groups"):
            value = getattr(self, name)
            if name == "replica_groups" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1 (replica groups)")
        for name in ("timeout", "quorum_timeout", "member_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < math.inf):
                raise ValueError(f"{name}={value!r} must be a positive number of seconds")

    def resolved(self, environ: Mapping[str, str] | None = None) -> TorchFT:
        """These settings with the lighthouse, replica id and replica groups taken from ``environ`` (default
        ``os.environ``) where not given.

        Raises:
            ValueError: the lighthouse or the replica id is given nowhere (the message names the argument and the
                variable), or ``$DDPKIT_REPLICA_GROUPS`` is not a whole number >= 1.
        """
        environ = os.environ if environ is None else environ
        lighthouse = self.lighthouse or environ.get(LIGHTHOUSE_VARIABLE) or None
        replica_id = self.replica_id or environ.get(REPLICA_ID_VARIABLE) or None
        missing = [
            f"{argument} (or ${variable})"
            for argument, variable, value in (
                ("lighthouse", LIGHTHOUSE_VARIABLE, lighthouse),
                ("replica_id", REPLICA_ID_VARIABLE, replica_id),
            )
            if value is None
        ]
        if missing:
            raise ValueError(
                f"fault tolerance on torchft needs {' and '.join(missing)}: pass "
                "fault_tolerance=TorchFT(lighthouse='http://HOST:PORT', replica_id='r0'), or set the variables "
                "(ddpkit.fault_tolerance.serve_lighthouse starts a lighthouse)"
            )
        groups = self.replica_groups
        if groups is None and environ.get(GROUPS_VARIABLE):
            text = environ[GROUPS_VARIABLE]
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"${GROUPS_VARIABLE}={text!r} must be a whole number >= 1 (the job's replica groups)")
            groups = int(text)
        return replace(self, lighthouse=lighthouse, replica_id=replica_id, replica_groups=groups)

    def join(
        self,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        step: int = 0,
    ) -> ReplicaGroup:
        """This process as a replica group of the job (:class:`ReplicaGroup`) from ``step`` (a checkpoint's), with
        :meth:`resolved` settings; a restart of the group where its launcher says so
        (``$TORCHELASTIC_RESTART_COUNT`` above 0).

        Raises:
            ValueError: no lighthouse or replica id (:meth:`resolved`).
            ImportError: torchft is not installed.
            JobEnded: the job finished, or cannot go on (its record says so).
        """
        settings = self.resolved()
        assert settings.lighthouse is not None
        assert settings.replica_id is not None
        return ReplicaGroup(
            settings.lighthouse, settings.replica_id, state_dict, load_state_dict, min_replicas=settings.min_replicas,
            timeout=settings.timeout, quorum_timeout=settings.quorum_timeout, replica_groups=settings.replica_groups,
            restarted=int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0,  # its agent started it again
            step=step, member_timeout=settings.member_timeout,
        )  # fmt: skip


def torchft_settings(value: str | TorchFT | None) -> TorchFT | None:
    """``TrainLoop``'s ``fault_tolerance`` argument as settings (``"torchft"``: :class:`TorchFT` defaults).

    Raises:
        ValueError: another string, or another type.
    """
    if value is None or isinstance(value, TorchFT):
        return value
    if value == "torchft":
        return TorchFT()
    raise ValueError(
        f"fault_tolerance={value!r}: use None, 'torchft' (settings from $TORCHFT_LIGHTHOUSE and $REPLICA_GROUP_ID) "
        "or ddpkit.fault_tolerance.TorchFT(...)"
    )
