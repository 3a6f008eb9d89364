from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from slurm_omni.errors import SlurmError, SlurmUnreachable
from slurm_omni.slurm.cli_backend import CliBackend
from slurm_omni.slurm.runner import CommandRunner, RateLimiter


def test_argv_must_be_a_list() -> None:
    with pytest.raises(SlurmError, match="argv must be"):
        CommandRunner().run("sinfo --json")  # type: ignore[arg-type]


def test_no_shell_interpretation(tmp_path: Path) -> None:
    hostile = "$(touch " + str(tmp_path / "pwned") + "); `id`"
    out = CommandRunner().run(["echo", hostile]).stdout
    assert out.strip() == hostile and not (tmp_path / "pwned").exists()


def test_missing_command_is_one_line() -> None:
    with pytest.raises(SlurmError, match="command not found"):
        CommandRunner().run(["omni-no-such-command"])


def test_timeout() -> None:
    with pytest.raises(SlurmUnreachable, match="couldn't finish within"):
        CommandRunner().run(["sleep", "5"], timeout_s=0.2)


def test_rate_limiter_sleeps_when_bucket_empty() -> None:
    limiter = RateLimiter(rate=50.0, burst=3)
    waits = [limiter.acquire() for _ in range(6)]
    assert waits[:3] == [0.0, 0.0, 0.0]
    assert all(w > 0 for w in waits[3:])        # the bucket was empty: each call had to wait


@pytest.mark.skipif(shutil.which("sinfo") is None, reason="slurm-client not installed (scripts/setup.sh)")
def test_retries_with_backoff_while_slurmctld_unreachable(tmp_path: Path, slurm_cluster) -> None:
    # A real sinfo, with the real munge, against a controller port nothing listens on: 22.05 exits 0
    # and reports the failure inside its JSON; the backend must see that as "unreachable" and retry.
    conf = tmp_path / "slurm.conf"
    munge = slurm_cluster.state_dir / "munge" / "munge.socket"
    conf.write_text(f"ClusterName=nowhere\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=1\n"
                    f"AuthType=auth/munge\nAuthInfo=socket={munge}\nMessageTimeout=1\n"
                    "NodeName=n1 State=UNKNOWN\nPartitionName=p Nodes=n1\n")
    backend = CliBackend({"SLURM_CONF": str(conf)}, retries=1, timeout_s=60)
    backend.runner.backoff_s = 0.01
    with pytest.raises(SlurmUnreachable, match="Unable to contact"):
        backend.nodes()
    assert backend.runner.calls == 2     # sinfo tried twice, then the error; no topology query
