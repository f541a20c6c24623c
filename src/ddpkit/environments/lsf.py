"""Processes started by LSF's ``jsrun`` (IBM Spectrum LSF, e.g. Summit-class machines)."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from ddpkit.environments.base import (
    ClusterEnvironment,
    ClusterSettings,
    check_below,
    env_or_os,
    int_var,
    require,
)
from ddpkit.errors import ClusterEnvironmentError

__all__ = ["LSFEnvironment"]

_REQUIRED = ("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK")


class LSFEnvironment(ClusterEnvironment):
    """One ``jsrun`` task per process.

    Detected by ``JSM_NAMESPACE_RANK``; reads ``JSM_NAMESPACE_RANK``,
    ``JSM_NAMESPACE_SIZE``, ``JSM_NAMESPACE_LOCAL_RANK`` and the rank file named
    by ``LSB_DJOB_RANKFILE`` (one host per line, the first being the launch node,
    which runs no task). The master address is the first compute host (or
    ``MASTER_ADDR``); the node rank is this host's index among the distinct
    compute hosts (the host name is ``HOSTNAME`` if set, else
    ``socket.gethostname()``); the port is ``MASTER_PORT``, else ``10000 +
    LSB_JOBID % 1000``.
    """

    name = "lsf"

    @staticmethod
    def detect(env: Mapping[str, str] | None = None) -> bool:
        return "JSM_NAMESPACE_RANK" in env_or_os(env)

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> ClusterSettings:
        require(env, _REQUIRED, "the LSF (jsrun) environment", "start the processes with jsrun")
        world_size = int_var(env, "JSM_NAMESPACE_SIZE")
        rank = int_var(env, "JSM_NAMESPACE_RANK")
        local_rank = int_var(env, "JSM_NAMESPACE_LOCAL_RANK")
        check_below("JSM_NAMESPACE_RANK", rank, "JSM_NAMESPACE_SIZE", world_size)
        check_below("JSM_NAMESPACE_LOCAL_RANK", local_rank, "JSM_NAMESPACE_SIZE", world_size)

        hosts = _compute_hosts(env["LSB_DJOB_RANKFILE"])
        distinct = list(dict.fromkeys(hosts))
        hostname = env.get("HOSTNAME", "").strip() or socket.gethostname()
        if hostname not in distinct:
            raise ClusterEnvironmentError(
                f"this host {hostname!r} is not in LSB_DJOB_RANKFILE={env['LSB_DJOB_RANKFILE']!r} "
                f"(compute hosts: {', '.join(distinct)})"
            )
        if env.get("MASTER_PORT", "").strip():
            port = int_var(env, "MASTER_PORT")
        else:
            port = 10000 + int_var(env, "LSB_JOBID") % 1000
        return ClusterSettings(
            master_addr=env.get("MASTER_ADDR", "").strip() or distinct[0],
            master_addr_source="MASTER_ADDR"
            if env.get("MASTER_ADDR", "").strip()
            else f"the first compute host of LSB_DJOB_RANKFILE={env['LSB_DJOB_RANKFILE']!r}",
            master_port=port,
            world_size=world_size,
            global_rank=rank,
            local_rank=local_rank,
            node_rank=distinct.index(hostname),
        )


def _compute_hosts(rankfile: str) -> list[str]:
    try:
        with open(rankfile, encoding="utf-8") as handle:
            lines = [line.strip() for line in handle if line.strip()]
    except OSError as exc:
        raise ClusterEnvironmentError(f"cannot read LSB_DJOB_RANKFILE={rankfile!r}: {exc}") from None
    if len(lines) < 2:
        raise ClusterEnvironmentError(
            f"LSB_DJOB_RANKFILE={rankfile!r} lists {len(lines)} host(s); expected the launch node then compute hosts"
        )
    return lines[1:]
