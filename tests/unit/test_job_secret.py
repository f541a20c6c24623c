"""A job secret a stranger cannot guess: too weak, or readable by other users, it is refused with the fix;
`ddpkit secret` makes a good one."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import pytest

from ddpkit import JobSecretError
from ddpkit._trust.secret import (
    MIN_SECRET_BITS,
    SECRET_VARIABLE,
    job_secret,
    read_secret_file,
    secret_bits,
    use_job_secret,
    write_secret_file,
)
from ddpkit.cli import main
from tests.helpers import JOB_SECRET


@pytest.mark.parametrize(
    "weak",
    [
        b"qzx",  # the 3 letters a stranger recovered from a signed job id in 12,192 HMACs
        b"s3cret",
        b"a secret only the job has",  # words: about 13 bits each
        b"correcthorsebatterystaple",  # lowercase letters: 4.7 bits each
        b"passwordpasswordpassword",  # repeated: it compresses
        b"0" * 64,
        b"9f3a61c07e2d4b85a1f6c39e0d7b24",  # 30 hex digits: 120 bits
        bytes.fromhex("d41f07a9c3e58b26f1904ce7a35b80"),  # 15 random bytes
    ],
)
def test_a_secret_below_128_bits_is_refused_naming_where_it_came_from_and_the_fix(weak: bytes) -> None:
    assert secret_bits(weak) < MIN_SECRET_BITS
    with pytest.raises(JobSecretError, match=r"from --secret-file /k has about \d+ bits of entropy, which a stranger "
                       r"could guess: .* Make one with `ddpkit secret PATH`") as refused:  # fmt: skip
        use_job_secret(weak, "--secret-file /k")
    assert isinstance(refused.value, ValueError)


def test_random_secrets_of_128_bits_or_more_are_taken_whatever_their_alphabet() -> None:
    for _ in range(200):
        for raw in (secrets.token_hex(16).encode(), secrets.token_urlsafe(16).encode(), secrets.token_bytes(16)):
            assert secret_bits(raw) >= MIN_SECRET_BITS, raw


def test_a_weak_secret_in_the_environment_is_refused_where_it_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_VARIABLE, "qzx")
    with pytest.raises(JobSecretError, match=f"the job secret from {SECRET_VARIABLE} has about"):
        job_secret()
    monkeypatch.setenv(SECRET_VARIABLE, "hex:" + "ab" * 15)  # a binary file of 15 bytes, as ddpkit run hands it on
    with pytest.raises(JobSecretError, match="bits of entropy"):
        job_secret()
    monkeypatch.setenv(SECRET_VARIABLE, f"  {JOB_SECRET}\n")
    assert job_secret() == JOB_SECRET.encode()


def test_a_secret_file_that_other_users_can_read_is_refused_naming_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(JOB_SECRET)
    for mode in (0o644, 0o640, 0o604, 0o620):
        path.chmod(mode)
        with pytest.raises(JobSecretError, match=rf"its permissions {mode:04o} let other users .* `chmod 600 {path}`"):
            read_secret_file(str(path))
    path.chmod(0o600)
    assert read_secret_file(str(path)) == JOB_SECRET.encode()
    path.write_text("qzx\n")
    with pytest.raises(JobSecretError, match=f"from --secret-file {path} has about"):
        read_secret_file(str(path))


def test_ddpkit_secret_makes_a_file_only_its_owner_reads_and_never_overwrites_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.key"
    assert main(["secret", str(path)]) == 0
    assert f"to {path}; give it to every node: --secret-file {path}" in capsys.readouterr().out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    made = read_secret_file(str(path))
    assert len(made) == 64
    assert secret_bits(made) == 256
    assert main(["secret", str(path)]) == 2
    assert "exists; a job may be using it" in capsys.readouterr().err
    assert read_secret_file(str(path)) == made
    other = tmp_path / "other.key"
    write_secret_file(str(other))
    assert read_secret_file(str(other)) != made


def test_ddpkit_run_refuses_a_world_readable_secret_file_before_it_starts_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "secret"
    path.write_text(JOB_SECRET)
    os.chmod(path, 0o644)
    assert main(["run", "--secret-file", str(path), "absent.py"]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"ddpkit run: --secret-file {path}: its permissions 0644 let other users"), said
    assert job_secret() is None or job_secret() != JOB_SECRET.encode()


def test_every_test_the_security_pages_threat_table_names_exists() -> None:
    """docs/security.md's table of who can do what names the test that holds each row: each one is there."""
    import re

    root = Path(__file__).parents[2]
    page = (root / "docs" / "security.md").read_text()
    table = page[page.index("## Who can do what") : page.index("## What listens during a job")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith(("| who", "| ---"))]
    assert len(rows) >= 10, rows
    for row in rows:
        named = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", row)
        assert named, f"a row without its test: {row}"
        for path, test in named:
            source = (root / path).read_text()
            assert not test or f"def {test}(" in source, f"{path}::{test} is not there"
