"""Every server listens on one address, no stranger's pickle runs (collectives, rendezvous), and a job secret
keeps strangers from joining.

Here, the tests that need no process; the others are in tests/ranks/test_security.py and tests/e2e/test_security.py.
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
import time
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from ddpkit import (
    PortTakenError,
    RendezvousFailedError,
    destroy_dist_connection,
    init_dist_connection,
)
from ddpkit._stores import local_addresses, release_store, route_address, serve_store
from ddpkit._trust.secret import SIGNED_HEADER_BYTES
from ddpkit.environments import LocalEnvironment
from ddpkit.jobs import _rendezvous
from ddpkit.jobs._agent import rendezvous
from ddpkit.jobs._agent import rendezvous_store as rendezvous_store_of_agent
from ddpkit.jobs._agent_log import agent_log
from tests.helpers import JOB_SECRET, listening_sockets, rendezvous_handler, state_holder
from tests.support.security import _check_exposure, _Exploit


def test_a_single_process_group_listens_on_loopback_only() -> None:
    listening_before = listening_sockets([os.getpid()])  # earlier tests' stores may be awaiting collection
    init_dist_connection(LocalEnvironment({}), "gloo")
    try:
        sockets, exposed = _check_exposure([os.getpid()])
        new = [socket for socket in sockets if socket not in listening_before]  # the group's
        assert new, "the group's store listens somewhere"
        assert {address for address, _ in new} == {"127.0.0.1"}
        assert [socket for socket in exposed if socket not in listening_before] == []
    finally:
        destroy_dist_connection()
    left = [socket for socket in listening_sockets([os.getpid()]) if socket not in listening_before]
    assert left == [], "the store closes with the group"  # (an earlier test's store may have closed meanwhile)


def test_a_port_held_by_another_program_is_named_with_the_fix() -> None:
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(PortTakenError, match=f"port {port} on 127.0.0.1 is taken by another program"):
            serve_store("127.0.0.1", port)
        started = time.monotonic()
        with pytest.raises(PortTakenError, match=r"taken by another program \(not a torch.distributed store\)"):
            serve_store("127.0.0.1", port, if_taken="peer")
        assert time.monotonic() - started < 10, "a silent listener does not hang the probe"


def test_a_port_held_by_a_peer_store_is_shared_when_peers_may_hold_it() -> None:
    peer = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    assert serve_store("127.0.0.1", peer.port, if_taken="peer") is None, "a second agent: a client"
    assert serve_store("127.0.0.1", peer.port, if_taken="torch") is None
    with pytest.raises(PortTakenError, match=f"port {peer.port} on 127.0.0.1 is taken by another program"):
        serve_store("127.0.0.1", peer.port)
    assert serve_store("10.1.2.3", 29500) is None, "not loopback: torch's own server, for remote peers"
    port = serve_store("localhost", 0)
    assert port is not None
    assert serve_store("127.0.0.1", port) == port, "a second holder within a process"
    release_store(port)
    assert ("127.0.0.1", port) in listening_sockets([os.getpid()]), "the first holder still needs it"
    release_store(port)
    gc.collect()
    assert ("127.0.0.1", port) not in listening_sockets([os.getpid()]), "the last holder stops it"


# --- pickles ------------------------------------------------------------------------------------


def test_the_launcher_log_is_a_new_private_file_that_a_planted_symlink_cannot_redirect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local user who can write the temp directory plants symlinks at every name the log could have had under
    the old predictable scheme (time and pid): the job writes none of them, only a new file of its own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_text("")
    now = time.time()
    for second in range(-2, 5):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now + second))
        (tmp_path / f"ddpkit-launch-{stamp}-{os.getpid()}.log").symlink_to(victim)
    with agent_log(str(tmp_path / "failures")) as log:
        logging.getLogger("torch.distributed.elastic").error("the agent's line")
        log.keep = True
    assert victim.read_text() == "", "nothing went through a planted symlink"
    assert not log.path.is_symlink()
    assert "the agent's line" in log.path.read_text()
    assert log.path.stat().st_mode & 0o777 == 0o600, "only the job's user reads it"


# --- the rendezvous ----------------------------------------------------------------------------

_REFUSED = r"rendezvous state in the store at 127\.0\.0\.1:\d+ \(key torch\.rendezvous\.job\) .* was refused: "


@pytest.fixture
def rendezvous_store() -> Any:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _write(store: TCPStore, raw: bytes) -> None:
    import base64

    store.set("torch.rendezvous.job", base64.b64encode(raw))


@pytest.mark.parametrize("secret", [None, JOB_SECRET.encode()], ids=["no secret", "secret"])
def test_a_rendezvous_of_real_agents_passes_the_check(
    rendezvous_store: TCPStore, secret: bytes | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = rendezvous_handler(rendezvous_store, secret, monkeypatch)
    assert handler.get_backend() == "ddpkit"
    info = handler.next_rendezvous()  # writes the state (signed with a secret), reads it back, completes
    assert (info.rank, info.world_size) == (0, 1)
    stored = rendezvous_store.get("torch.rendezvous.job")
    import base64

    assert base64.b64decode(stored).startswith(b"ddpkit-hmac-sha256") == (secret is not None)
    handler.shutdown()


def test_a_pickle_that_would_run_code_is_refused_before_it_is_loaded(
    rendezvous_store: TCPStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    marker = tmp_path / "ran"
    holder = state_holder(rendezvous_handler(rendezvous_store, None, monkeypatch))
    state = _RendezvousState()
    state.closed = _Exploit(str(marker))  # type: ignore[assignment]  # inside a real state
    for payload, named in (
        (pickle.dumps(_Exploit(str(marker))), "tests.support.security._mark"),
        (pickle.dumps(state), "tests.support.security._mark"),
        (pickle.dumps(print), "builtins.print"),
    ):
        _write(rendezvous_store, payload)
        with pytest.raises(_rendezvous.StateRefusedError, match=_REFUSED + f"it names {named}") as caught:
            holder.sync()
        assert "Nothing of it ran" in str(caught.value)
        assert "Security page (docs/security.md)" in str(caught.value)
    assert not list(tmp_path.glob("ran*")), "the payload ran"


def test_1000_random_and_truncated_states_are_each_refused_with_the_clear_error(
    rendezvous_store: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random bytes, every truncation of a real state, other pickles and non-base64 text: each is refused by torch's
    own state holder with the refusal, never another error; a real state with random bytes changed is either
    refused or a well-formed state."""
    import pickle
    import random

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    holder = state_holder(rendezvous_handler(rendezvous_store, None, monkeypatch))
    real = _RendezvousState()
    real.participants = {_NodeDesc("10.0.0.1", 100, 0): 0, _NodeDesc("10.0.0.2", 200, 0): 1}
    real.last_heartbeats = {node: datetime.now(UTC) for node in real.participants}
    real_bytes = pickle.dumps(real)
    generator = random.Random(1234)
    cases = [real_bytes[:cut] for cut in range(len(real_bytes))]
    cases += [pickle.dumps(value) for value in (0, None, {"round": 1}, [real.participants], real.participants)]
    cases += [generator.randbytes(generator.randrange(0, 600)) for _ in range(990 - len(cases))]
    text = [generator.choice([b"!!", b"=", b"%%%"]) + generator.randbytes(20) for _ in range(10)]
    for raw in cases:
        _write(rendezvous_store, raw)
        with pytest.raises(_rendezvous.StateRefusedError, match=_REFUSED):
            holder.sync()
    for raw in text:  # written as they are: not base64 at all
        rendezvous_store.set("torch.rendezvous.job", raw)
        with pytest.raises(_rendezvous.StateRefusedError, match=_REFUSED):
            holder.sync()
    rendezvous_store.set("torch.rendezvous.job", b"abcde")
    with pytest.raises(_rendezvous.StateRefusedError, match=_REFUSED + "it is not base64 text"):
        holder.sync()
    assert len(cases) + len(text) == 1000
    admitted = 0
    for _ in range(300):
        changed = bytearray(real_bytes)
        for _ in range(generator.randrange(1, 4)):
            changed[generator.randrange(len(changed))] = generator.randrange(256)
        _write(rendezvous_store, bytes(changed))
        try:
            holder.sync()
        except _rendezvous.StateRefusedError:
            continue
        admitted += 1
        assert type(holder.state) is _RendezvousState
        assert type(holder.state.closed) is bool
    assert admitted < 300, "the changes were looked at"


def test_with_a_secret_a_forged_state_that_adds_a_node_is_refused(
    rendezvous_store: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import base64
    import pickle

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    handler = rendezvous_handler(rendezvous_store, JOB_SECRET.encode(), monkeypatch)
    handler.next_rendezvous()
    holder = state_holder(handler)
    holder.sync()
    signed = base64.b64decode(rendezvous_store.get("torch.rendezvous.job"))
    at = SIGNED_HEADER_BYTES + 8  # mark, version, signature, counter
    head, state = signed[:at], pickle.loads(signed[at:])  # the test reads its own store
    state.participants[_NodeDesc("10.9.9.9", 1, 0)] = 1
    forged = pickle.dumps(state)
    for raw, why in (
        (head + forged, "its signature does not match this node's job secret"),
        (forged, r"it is not signed, and this node has a job secret"),
    ):
        _write(rendezvous_store, raw)
        with pytest.raises(_rendezvous.StateRefusedError, match=_REFUSED + why):
            holder.sync()
    monkeypatch.delenv(_rendezvous.SECRET_VARIABLE)
    unsigned = state_holder(rendezvous_handler(rendezvous_store, None, monkeypatch))
    _write(rendezvous_store, signed)
    with pytest.raises(_rendezvous.StateRefusedError, match="it is signed with a job secret and this node has none"):
        unsigned.sync()
    _write(rendezvous_store, forged)
    unsigned.sync()  # without a secret, a well-formed state is taken: the Security page says so
    assert len(unsigned.state.participants) == 2
    handler.shutdown()


def test_a_node_told_to_host_a_rendezvous_that_is_not_its_own_says_which_addresses_it_has() -> None:
    expected = r"host the rendezvous at 10\.1\.2\.3, but 10\.1\.2\.3 resolves to 10\.1\.2\.3; this machine's addresses"
    with pytest.raises(RendezvousFailedError, match=expected + r" are .*127\.0\.0\.1"):
        rendezvous_store_of_agent("10.1.2.3:29400", 2, {"is_host": "true"}).__enter__()
    assert route_address("127.0.0.1") == "127.0.0.1"
    assert "127.0.0.1" in local_addresses()
    with rendezvous_store_of_agent("10.1.2.3:29400", 2, {"is_host": "false"}) as endpoint:
        assert endpoint == "10.1.2.3:29400", "not the host: a client, nothing served"


def test_a_multi_node_rendezvous_takes_the_schedulers_job_id_and_warns_once_without_a_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(_rendezvous.SECRET_VARIABLE, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setattr(_rendezvous, "_warned", set())
    with pytest.warns(UserWarning, match=r"no job secret: .* at 127\.0\.0\.1:29555 \(port 29555\) .*DDPKIT_JOB_SE"):
        assert rendezvous(2, "127.0.0.1:29555", None)[1] == "ddpkit-4711"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rendezvous(2, "127.0.0.1:29555", "mine")[1] == "mine", "once per endpoint; a given id is kept"
        monkeypatch.setenv(_rendezvous.SECRET_VARIABLE, JOB_SECRET)
        rendezvous(2, "127.0.0.1:29556", None)
        assert rendezvous(1, None, None)[1] != rendezvous(1, None, None)[1], "one node: a fresh id"


def test_ddpkit_run_reads_the_secret_file_and_names_one_it_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddpkit.cli import main

    missing = tmp_path / "missing"
    assert main(["run", "--secret-file", str(missing), "x.py"]) == 2
    assert f"--secret-file {missing}: " in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    assert main(["run", "--secret-file", str(empty), "x.py"]) == 2
    assert f"the job secret from --secret-file {empty} is empty" in capsys.readouterr().err
    secret = tmp_path / "secret"
    secret.write_text(JOB_SECRET + "\n")
    secret.chmod(0o600)
    try:
        assert main(["run", "--secret-file", str(secret), str(tmp_path / "absent.py")]) == 2
        assert _rendezvous.job_secret() == JOB_SECRET.encode()
    finally:
        _rendezvous.use_job_secret(None)
