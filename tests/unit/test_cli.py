"""The ddpkit command: env (in process), argument errors, and ddpkit run on real scripts (e2e).

Here, the tests that need no process; the others are in tests/e2e/test_cli.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpkit.cli import main

# --- in process ------------------------------------------------------------------------------


def test_env_prints_the_detected_environment_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["environment"], data["world_size"], data["global_rank"]) == ("local", 1, 0)
    assert "gloo" in data["distributed_backends"]


def test_env_reads_a_slurm_job(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in {"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                        "SLURM_JOB_NODELIST": "cn[07-08]", "SLURM_JOB_ID": "991234"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    assert main(["env"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["environment"], data["master_addr"], data["master_port"]) == ("slurm", "cn07", 16234)
    assert (data["world_size"], data["global_rank"], data["local_rank"], data["node_rank"]) == (4, 3, 1, 1)


def test_env_reports_bad_variables_and_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DDPKIT_CLUSTER_ENV", "nowhere")
    assert main(["env"]) == 1
    assert "DDPKIT_CLUSTER_ENV='nowhere' is not an environment" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["demo", "--epochs", "many"], ["doctor", "--peer-timeout", "soon"]])
def test_bad_command_lines_exit_with_usage(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "-n", "0", "x.py"], "nprocs=0 must be an integer >= 1"),
        (["run", "--nnodes", "2", "x.py"], "needs rdzv_endpoint"),
        (["run"], "SCRIPT is required (or --doctor)"),
        (["doctor", "-n", "0"], "nprocs=0 must be an integer >= 1"),
        (["demo", "--epochs", "0"], "epochs=0"),
        (["demo", "--nprocs", "0"], "nprocs=0 must be an integer >= 1"),
        (["demo", "--task", "retrieval", "--batch-size", "30"], "must be a multiple of 4"),
        (["demo", "--task", "retrieval", "--batch-size", "48"], "classes_per_batch=12 in [2, 10]"),
    ],
)
def test_bad_values_exit_2_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "-n", "2", "missing.py"], "ddpkit run: no such script: missing.py (relative to {cwd})\n"),
        (["run", "-n", "2", "-m", "no_such_module"], "ddpkit run: no module named 'no_such_module' (looked on"),
    ],
)
def test_a_missing_script_or_module_is_one_line_before_any_worker_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(cwd=tmp_path)), err
    assert err.count("\n") == 1
    assert "Traceback" not in err
