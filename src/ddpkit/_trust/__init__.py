"""Everything that makes a job trust only its own processes, with one job secret (private).

``secret``: the job secret (where a process finds it, how strong it must be), the one tag it makes (HMAC-SHA256 over
length-prefixed parts, each purpose named) and the one format of every value signed with it (a mark, a version byte,
the tag, the value: ``sign``/``signed_value``; another version's is refused). ``sealed``: a group's keys in its
store, signed for the group and, where private, sealed with ChaCha20-Poly1305 (the ``cryptography`` package).
``group_store``: the store a new group's members meet at, every value there signed for the group (what the group is:
the job, its attempt, an id its rank 0 draws). ``group_proof``: every member proving that it holds the secret over
the group's own connections before the job's data moves, bound to what each member sees of those connections
(``channel``), so that a relay fails it. Built on these, where the launcher's and torchft's own parts are: the
rendezvous's signed state and rounds (``jobs._rendezvous``, ``jobs._round_store``, ``jobs._state_check``) and the
quorums' proof (``fault_tolerance._quorum_proof``), each signing through ``secret``'s format (they stay beside the
launcher's and torchft's classes they wrap: this package imports neither). docs/security.md says what each refuses,
and which test shows it.

The modules were once at the package's root (``ddpkit._secret``, ...): those paths are the same modules still.
"""
