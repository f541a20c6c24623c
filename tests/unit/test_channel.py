"""What each member sees of a gloo group's connections: both ends of one connection agree, a relay's two
connections do not, and both members name the relay's address."""

from __future__ import annotations

import socket

from ddpkit._trust.channel import Channel, established_connections, normal

A, B, RELAY = "10.0.0.1:4000", "10.0.0.2:5000", "10.0.0.9:7000"


def _views(a_connections: list[tuple[str, str]], b_connections: list[tuple[str, str]]) -> tuple[Channel, Channel]:
    listen = {0: [A], 1: [B]}
    return Channel(0, listen, a_connections), Channel(1, listen, b_connections)


def test_the_two_ends_of_one_connection_agree_whichever_side_connected() -> None:
    a, b = _views([("10.0.0.1:41000", B)], [(B, "10.0.0.1:41000")])  # rank 0 connected to rank 1
    assert a.mismatch(1, b.view()) is None
    assert b.mismatch(0, a.view()) is None
    a, b = _views([(A, "10.0.0.2:52000")], [("10.0.0.2:52000", A)])  # rank 1 connected to rank 0
    assert a.mismatch(1, b.view()) is None
    assert b.mismatch(0, a.view()) is None


def test_a_relay_on_both_connections_is_found_by_both_members_naming_where_it_came_from() -> None:
    """Rank 0 thinks it reached rank 1 (the network sent it to the relay); the relay connected to rank 1 itself."""
    a, b = _views([("10.0.0.1:41000", B)], [(B, "10.0.0.9:60001")])
    from_a = a.mismatch(1, b.view())
    from_b = b.mismatch(0, a.view())
    assert from_a is not None
    assert from_b is not None
    assert "connected to it from 10.0.0.1:41000, but the connections that reached it came from 10.0.0.9:60001" in from_a
    assert "it connected to this rank from 10.0.0.1:41000, but the connections that reached this rank came from " \
        "10.0.0.9:60001: something between them relays" in from_b  # fmt: skip


def test_an_address_the_member_does_not_listen_on_is_named() -> None:
    """Rank 0 was given an address of rank 1's from an earlier job (a port a stranger now holds)."""
    a = Channel(0, {0: [A], 1: [RELAY]}, [("10.0.0.1:41000", RELAY)])
    b = Channel(1, {0: [A], 1: [B]}, [(B, "10.0.0.9:60001")])
    said = a.mismatch(1, b.view())
    assert said == "the group's store gave this rank 10.0.0.9:7000 as its address, but it listens on 10.0.0.2:5000"


def test_a_member_that_cannot_tell_is_passed_over_and_other_connections_do_not_count() -> None:
    a, b = _views([("10.0.0.1:41000", B), ("10.0.0.1:33333", "10.0.0.5:22")], [(B, "10.0.0.1:41000")])
    assert b.mismatch(0, a.view()) is None, "a connection to something else is not the group's"
    assert Channel(1, {0: [A], 1: [B]}, None).view() == b""
    assert b.mismatch(0, b"") is None
    stranger_probe = [(B, "10.0.0.1:41000"), (B, "10.0.0.66:1234")]  # a stranger connected to rank 1's listener
    a, b = _views([("10.0.0.1:41000", B)], stranger_probe)
    assert a.mismatch(1, b.view()) is None
    assert b.mismatch(0, a.view()) is None


def test_this_process_s_connections_are_read_as_both_ends_see_them() -> None:
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        with socket.socket(family) as server:
            server.bind((host, 0))
            server.listen()
            with socket.create_connection(server.getsockname()[:2]) as client:
                accepted, _ = server.accept()
                with accepted:
                    found = established_connections()
                    assert found is not None
                    here = normal(f"[{host}]:{client.getsockname()[1]}")
                    there = normal(f"[{host}]:{server.getsockname()[1]}")
                    assert (here, there) in found
                    assert (there, here) in found
    assert normal("[::ffff:10.1.2.3]:80") == "10.1.2.3:80"
