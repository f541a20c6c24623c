"""Tasks started by SLURM's ``srun``."""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.environments.base import (
    ClusterEnvironment,
    ClusterSettings,
    check_below,
    env_or_os,
    int_var,
    port_from_job_id,
    require,
)
from ddpkit.errors import ClusterEnvironmentError

__all__ = ["SLURMEnvironment", "expand_hostlist"]

_INTERACTIVE_JOB_NAMES = ("bash", "interactive")


class SLURMEnvironment(ClusterEnvironment):
    """One ``srun`` task per process.

    Detected by ``SLURM_NTASKS`` or ``SLURM_PROCID``, unless ``SLURM_JOB_NAME`` is
    ``bash`` or ``interactive`` (an interactive allocation, where you start the
    processes yourself); ``DDPKIT_CLUSTER_ENV=local`` also turns it off. Reads
    ``SLURM_PROCID`` (global rank), ``SLURM_NTASKS`` (world size),
    ``SLURM_LOCALID`` (local rank), ``SLURM_NODEID`` (node rank; without it, the
    place of ``SLURMD_NODENAME`` in the node list, or 0 on one node). The master
    address is ``MASTER_ADDR`` if set, else the first host of
    ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``), bracket ranges such as
    ``node[001-004,007]`` included. The master port is ``MASTER_PORT`` if set,
    else ``15000`` plus the last four digits of ``SLURM_JOB_ID``, so that every
    task of the job derives the same port. The tasks on this node (which share
    its CPU cores) come from ``SLURM_STEP_TASKS_PER_NODE`` or
    ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``), else ``SLURM_NTASKS_PER_NODE``.
    """

    name = "slurm"

    @staticmethod
    def detect(env: Mapping[str, str] | None = None) -> bool:
        source = env_or_os(env)
        if source.get("SLURM_JOB_NAME", "") in _INTERACTIVE_JOB_NAMES:
            return False
        return "SLURM_NTASKS" in source or "SLURM_PROCID" in source

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> ClusterSettings:
        fix = "run the processes with srun, or set DDPKIT_CLUSTER_ENV=local to ignore SLURM"
        require(env, ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"), "the SLURM environment", fix)
        nodelist_var = "SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST", "").strip() else "SLURM_NODELIST"
        world_size = int_var(env, "SLURM_NTASKS")
        rank = int_var(env, "SLURM_PROCID")
        local_rank = int_var(env, "SLURM_LOCALID")
        check_below("SLURM_PROCID", rank, "SLURM_NTASKS", world_size)
        check_below("SLURM_LOCALID", local_rank, "SLURM_NTASKS", world_size)

        master_addr = env.get("MASTER_ADDR", "").strip()
        source = "MASTER_ADDR"
        nodelist = env.get(nodelist_var, "").strip()
        hosts = expand_hostlist(nodelist) if nodelist else []
        node_rank = _node_rank(env, hosts, nodelist_var)
        if hosts:
            check_below("SLURM_NODEID", node_rank, f"the number of hosts in {nodelist_var}={nodelist!r}", len(hosts))
            if not master_addr:
                master_addr, source = hosts[0], f"the first host of {nodelist_var}={nodelist!r}"
        if not master_addr:
            raise ClusterEnvironmentError(
                "the SLURM environment is half-set: neither SLURM_JOB_NODELIST nor SLURM_NODELIST "
                "nor MASTER_ADDR is set; " + fix
            )
        if env.get("MASTER_PORT", "").strip():
            master_port = int_var(env, "MASTER_PORT")
        elif env.get("SLURM_JOB_ID", "").strip():
            master_port = port_from_job_id(env["SLURM_JOB_ID"], "SLURM_JOB_ID")
        else:
            raise ClusterEnvironmentError(
                "the SLURM environment is half-set: neither SLURM_JOB_ID nor MASTER_PORT is set; " + fix
            )
        local_world_size = _tasks_on_this_node(env, node_rank, len(hosts), world_size)
        if local_world_size is not None and not local_rank < local_world_size <= world_size:
            local_world_size = None  # contradicts SLURM_LOCALID: unknown rather than wrong
        return ClusterSettings(
            master_addr, master_port, world_size, rank, local_rank, node_rank, local_world_size, source
        )


def _tasks_on_this_node(env: Mapping[str, str], node_rank: int, hosts: int, world_size: int) -> int | None:
    """This node's task count: from ``SLURM_STEP_TASKS_PER_NODE`` or ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``,
    one count per node), else ``SLURM_NTASKS_PER_NODE``, else all tasks when the job has one host; else ``None``."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        counts = _expand_tasks_per_node(env.get(name, ""))
        if counts is not None and node_rank < len(counts):
            return counts[node_rank]
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").strip()
    if per_node.isdigit() and int(per_node) > 0:
        return int(per_node)
    return world_size if hosts == 1 else None


def _expand_tasks_per_node(value: str) -> list[int] | None:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]``; ``None`` when unset or not in that form."""
    counts: list[int] = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        count, _, repeat = item.partition("(x")
        repeat = repeat.rstrip(")") if repeat else "1"
        if not (count.isdigit() and repeat.isdigit()) or int(count) < 1:
            return None
        counts += [int(count)] * int(repeat)
    return counts or None


def _node_rank(env: Mapping[str, str], hosts: list[str], nodelist_var: str) -> int:
    """``SLURM_NODEID``; else this host's place in the node list (``SLURMD_NODENAME``); else 0 on one node."""
    if env.get("SLURM_NODEID", "").strip():
        return int_var(env, "SLURM_NODEID")
    name = env.get("SLURMD_NODENAME", "").strip()
    if name and name in hosts:
        return hosts.index(name)
    if len(hosts) <= 1:
        return 0
    raise ClusterEnvironmentError(
        f"the SLURM environment is half-set: SLURM_NODEID is not set and SLURMD_NODENAME={name!r} does not name a "
        f"host of {nodelist_var} ({len(hosts)} hosts), so this task's node is unknown; run the processes with srun"
    )


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a SLURM host list into host names, in order.

    Handles comma-separated hosts and bracket ranges with zero padding, several
    per name: ``"node[001-003,007],gpu1"`` gives ``node001 node002 node003
    node007 gpu1``; ``"r[1-2]n[1-2]"`` gives ``r1n1 r1n2 r2n1 r2n2``.

    Raises:
        ClusterEnvironmentError: unbalanced brackets, an empty item or a
            descending or non-numeric range; the message quotes the list.
    """
    hosts: list[str] = []
    for expression in _split_top_level(nodelist):
        hosts.extend(_expand_expression(expression, nodelist))
    if not hosts:
        raise ClusterEnvironmentError(f"host list {nodelist!r} is empty")
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current = ""
    for char in nodelist.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ClusterEnvironmentError(f"host list {nodelist!r} has unbalanced brackets")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ClusterEnvironmentError(f"host list {nodelist!r} has unbalanced brackets")
    parts.append(current)
    if any(not part.strip() for part in parts):
        raise ClusterEnvironmentError(f"host list {nodelist!r} has an empty item")
    return [part.strip() for part in parts]


def _expand_expression(expression: str, nodelist: str) -> list[str]:
    start = expression.find("[")
    if start < 0:
        return [expression]
    end = expression.index("]", start)
    prefix, body, rest = expression[:start], expression[start + 1 : end], expression[end + 1 :]
    suffixes = _expand_expression(rest, nodelist)
    expanded: list[str] = []
    for item in body.split(","):
        for number in _expand_range(item.strip(), nodelist):
            expanded.extend(prefix + number + suffix for suffix in suffixes)
    return expanded


def _expand_range(item: str, nodelist: str) -> list[str]:
    low, _, high = item.partition("-")
    high = high or low
    if not (low.isdigit() and high.isdigit()):
        raise ClusterEnvironmentError(f"host list {nodelist!r} has a non-numeric range {item!r}")
    if int(high) < int(low):
        raise ClusterEnvironmentError(f"host list {nodelist!r} has a descending range {item!r}")
    width = len(low)
    return [str(number).zfill(width) for number in range(int(low), int(high) + 1)]
