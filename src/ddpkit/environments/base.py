"""The cluster-environment interface and the pure helpers every environment parses with."""

from __future__ import annotations

import ipaddress
import os
import socket
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from ddpkit.errors import ClusterEnvironmentError

__all__ = ["ClusterEnvironment", "ClusterSettings", "check_resolves", "find_free_port", "is_loopback"]


@dataclass(frozen=True)
class ClusterSettings:
    """Where one process sits in a job, as parsed from its environment variables.

    Attributes:
        master_addr: host name or address of the rank-0 store.
        master_port: TCP port of the rank-0 store; ``0`` means "pick a free port
            when first asked" (only :class:`~ddpkit.LocalEnvironment` does that).
        world_size: number of processes in the job.
        global_rank: this process's rank in ``[0, world_size)``.
        local_rank: this process's rank on its node.
        node_rank: index of this process's node.
        local_world_size: number of this job's processes on this node, or
            ``None`` when the variables do not say (used to share the node's
            CPU cores among them).
        master_addr_source: where ``master_addr`` came from, for error messages
            (``"MASTER_ADDR"``, ``"the first host of SLURM_JOB_NODELIST='...'"``).
    """

    master_addr: str
    master_port: int
    world_size: int
    global_rank: int
    local_rank: int
    node_rank: int
    local_world_size: int | None = None
    master_addr_source: str = "MASTER_ADDR"

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ClusterEnvironmentError(f"world size must be >= 1, got {self.world_size}")
        if not 0 <= self.global_rank < self.world_size:
            raise ClusterEnvironmentError(
                f"global rank {self.global_rank} is outside [0, world size {self.world_size})"
            )
        if not 0 <= self.local_rank < self.world_size:
            raise ClusterEnvironmentError(f"local rank {self.local_rank} is outside [0, world size {self.world_size})")
        if not 0 <= self.node_rank < self.world_size:
            raise ClusterEnvironmentError(f"node rank {self.node_rank} is outside [0, world size {self.world_size})")
        if not 0 <= self.master_port < 65536:
            raise ClusterEnvironmentError(f"master port {self.master_port} is outside [0, 65535]")
        if self.local_world_size is not None and not self.local_rank < self.local_world_size <= self.world_size:
            raise ClusterEnvironmentError(
                f"local world size {self.local_world_size} must be in (local rank {self.local_rank}, "
                f"world size {self.world_size}]"
            )


class ClusterEnvironment(ABC):
    """Describes the processes of a job as a cluster scheduler or launcher set them up.

    Subclasses parse a ``Mapping[str, str]`` (``os.environ`` by default) once, at
    construction, into a frozen :class:`ClusterSettings`; the getters only read it
    and never write ``os.environ``. Methods ``master_address()``, ``master_port()``
    and ``world_size()`` are the ones Lightning 1.x's ``DDPPlugin`` calls (its
    ``cluster_environment``).

    Args:
        env: the environment variables to parse; ``None`` means ``os.environ``.

    Raises:
        ClusterEnvironmentError: a variable this environment needs is missing, not
            an integer, or contradicts another (e.g. a rank >= the world size);
            the message names each variable and its value.
    """

    #: The name used by ``DDPKIT_CLUSTER_ENV`` and ``ddpkit env``.
    name: ClassVar[str]

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.settings: ClusterSettings = self.parse(os.environ if env is None else env)

    @staticmethod
    @abstractmethod
    def detect(env: Mapping[str, str] | None = None) -> bool:
        """Whether ``env`` (default ``os.environ``) looks like this environment."""

    @classmethod
    @abstractmethod
    def parse(cls, env: Mapping[str, str]) -> ClusterSettings:
        """Parse ``env`` into settings; raise :class:`ClusterEnvironmentError` if it is inconsistent."""

    @property
    def creates_processes_externally(self) -> bool:
        """True when something other than ddpkit (a scheduler, torchrun) started every process."""
        return True

    def master_address(self) -> str:
        """Host name or address of the rank-0 store."""
        return self.settings.master_addr

    def master_port(self) -> int:
        """TCP port of the rank-0 store."""
        return self.settings.master_port

    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.settings.world_size

    def global_rank(self) -> int:
        """This process's rank in ``[0, world_size())``."""
        return self.settings.global_rank

    def local_rank(self) -> int:
        """This process's rank on its node (the CUDA device it should use)."""
        return self.settings.local_rank

    def node_rank(self) -> int:
        """Index of this process's node."""
        return self.settings.node_rank

    def master_address_source(self) -> str:
        """Where :meth:`master_address` came from (a variable, or how it was derived), for error messages."""
        return self.settings.master_addr_source

    def local_world_size(self) -> int | None:
        """Number of this job's processes on this node; ``None`` when the environment does not say."""
        return self.settings.local_world_size

    def as_dict(self) -> dict[str, Any]:
        """The environment as plain data (what ``ddpkit env`` prints)."""
        data: dict[str, Any] = {"environment": self.name}
        data.update(asdict(self.settings))
        data["master_port"] = self.master_port()
        data["creates_processes_externally"] = self.creates_processes_externally
        return data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.settings})"


# --- pure parsing helpers shared by the environments -------------------------------


def env_or_os(env: Mapping[str, str] | None) -> Mapping[str, str]:
    """``env`` itself, or ``os.environ`` when it is ``None``."""
    return os.environ if env is None else env


def int_var(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """The integer value of ``env[name]``, or ``default`` when it is unset.

    Raises:
        ClusterEnvironmentError: unset without a default, or not a non-negative integer.
    """
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ClusterEnvironmentError(f"{name} is not set")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ClusterEnvironmentError(f"{name}={raw!r} is not an integer") from None
    if value < 0:
        raise ClusterEnvironmentError(f"{name}={raw!r} is negative")
    return value


def require(env: Mapping[str, str], names: Iterable[str], what: str, fix: str = "") -> None:
    """Raise if any of ``names`` is unset, listing which are set (with values) and which are not."""
    names = list(names)
    missing = [n for n in names if not env.get(n, "").strip()]
    if missing:
        present = ", ".join(f"{n}={env[n]!r}" for n in names if n not in missing)
        message = f"{what} is half-set: {', '.join(missing)} not set"
        if present:
            message += f" (while {present})"
        raise ClusterEnvironmentError(message + (f"; {fix}" if fix else ""))


def check_below(name: str, value: int, limit_name: str, limit: int) -> None:
    """Raise naming both variables unless ``value < limit``."""
    if value >= limit:
        raise ClusterEnvironmentError(f"{name}={value} must be smaller than {limit_name}={limit}")


def port_from_job_id(job_id: str, name: str) -> int:
    """A port in [15000, 24999] that every process of the job derives alike from its job id.

    Numeric ids use their last four digits (as Lightning does for SLURM); other ids
    are hashed with CRC-32.
    """
    job_id = job_id.strip()
    if not job_id:
        raise ClusterEnvironmentError(f"{name} is empty; set MASTER_PORT instead")
    if job_id.isdigit():
        return 15000 + int(job_id[-4:])
    return 15000 + zlib.crc32(job_id.encode()) % 10000


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def check_resolves(host: str, source: str) -> None:
    """Raise unless ``host`` resolves to an address, before any process waits to meet the others there.

    Raises:
        ClusterEnvironmentError: naming the host, where it came from (``source``) and the resolver's answer.
    """
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ClusterEnvironmentError(
            f"the master address {host!r} ({source}) does not resolve ({reason}); every rank would wait there "
            "for the others until a timeout. Fix: make the host name resolvable on every node (DNS or /etc/hosts), "
            "or export MASTER_ADDR=<an address of rank 0's node that every node can reach>"
        ) from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface (``127.x``, ``::1``, ``localhost``)."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
