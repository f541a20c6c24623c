"""The default environment: one machine, loopback, a free port; or plain env:// variables."""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.environments.base import (
    ClusterEnvironment,
    ClusterSettings,
    check_below,
    env_or_os,
    find_free_port,
    int_var,
)
from ddpkit.errors import ClusterEnvironmentError

__all__ = ["LocalEnvironment"]


class LocalEnvironment(ClusterEnvironment):
    """A single process, or processes started by hand with the env:// variables.

    Reads ``MASTER_ADDR`` (default ``127.0.0.1``), ``MASTER_PORT`` (default: a free
    port on loopback, chosen once per instance when first asked), ``WORLD_SIZE``
    (default 1), ``RANK`` (default 0), ``LOCAL_RANK`` (default 0) and
    ``NODE_RANK`` (default 0). ``RANK`` and ``WORLD_SIZE`` go together: a world
    size above 1 needs a rank, and a rank needs a world size.

    Example:
        >>> env = LocalEnvironment({})
        >>> env.world_size(), env.global_rank(), env.master_address()
        (1, 0, '127.0.0.1')
    """

    name = "local"

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        source = env_or_os(env)
        super().__init__(source)
        self._external = bool(source.get("RANK", "").strip())
        self._chosen_port: int | None = None

    @staticmethod
    def detect(env: Mapping[str, str] | None = None) -> bool:
        """Always true: this is the fallback when nothing else is detected."""
        return True

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> ClusterSettings:
        has_rank = bool(env.get("RANK", "").strip())
        has_size = bool(env.get("WORLD_SIZE", "").strip())
        world_size = int_var(env, "WORLD_SIZE", 1)
        if has_rank and not has_size:
            raise ClusterEnvironmentError(
                f"RANK={env['RANK']!r} is set but WORLD_SIZE is not; set both (or neither, for one process)"
            )
        if world_size > 1 and not has_rank:
            raise ClusterEnvironmentError(
                f"WORLD_SIZE={env['WORLD_SIZE']!r} is set but RANK is not; set RANK in each process"
            )
        rank = int_var(env, "RANK", 0)
        local_rank = int_var(env, "LOCAL_RANK", 0)
        check_below("RANK", rank, "WORLD_SIZE", world_size)
        check_below("LOCAL_RANK", local_rank, "WORLD_SIZE", world_size)
        given = env.get("MASTER_ADDR", "").strip()
        return ClusterSettings(
            master_addr=given or "127.0.0.1",
            master_addr_source="MASTER_ADDR" if given else "the default (MASTER_ADDR is not set)",
            master_port=int_var(env, "MASTER_PORT", 0),
            world_size=world_size,
            global_rank=rank,
            local_rank=local_rank,
            node_rank=int_var(env, "NODE_RANK", 0),
            local_world_size=_local_world_size(env, local_rank, world_size),
        )

    @property
    def creates_processes_externally(self) -> bool:
        """True when ``RANK`` was set, i.e. someone else started these processes."""
        return self._external

    @property
    def port_was_chosen(self) -> bool:
        """True when ``MASTER_PORT`` was unset and this instance picks a free port itself.

        Such a port is private to this process: other processes cannot know it.
        """
        return self.settings.master_port == 0

    def master_port(self) -> int:
        """``MASTER_PORT``, or a free loopback port picked on the first call and kept."""
        if self.settings.master_port:
            return self.settings.master_port
        if self._chosen_port is None:
            self._chosen_port = find_free_port()
        return self._chosen_port


def _local_world_size(env: Mapping[str, str], local_rank: int, world_size: int) -> int | None:
    """``LOCAL_WORLD_SIZE`` when set and consistent; 1 for a lone process; else unknown."""
    if not env.get("LOCAL_WORLD_SIZE", "").strip():
        return 1 if world_size == 1 else None
    value = int_var(env, "LOCAL_WORLD_SIZE")
    check_below("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", value)
    if value > world_size:
        raise ClusterEnvironmentError(f"LOCAL_WORLD_SIZE={value} must not exceed WORLD_SIZE={world_size}")
    return value
