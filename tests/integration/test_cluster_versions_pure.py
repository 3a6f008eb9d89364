"""The pure parts of running another Slurm version: the mirror from apt's sources, the version
table, the config differences, the client wrappers' quoting and what is bound into the root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_omni.cluster.chroot import job_binds, render_client_wrapper
from slurm_omni.cluster.spec import ClusterPaths, ClusterSpec, render_cgroup_conf, render_slurm_conf
from slurm_omni.cluster.versions import VERSIONS, debian_mirror, roots_dir, slurm_version
from slurm_omni.errors import ConfigError

DEB822 = """Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://mirror.example/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
"""


@pytest.mark.parametrize("sources, mirror", [
    ([("debian.sources", DEB822)], "http://mirror.example/debian"),
    ([("sources.list", "# a comment\ndeb [arch=amd64] https://deb.example/debian bookworm main\n")],
     "https://deb.example/debian"),
    ([("sources.list", "deb http://security.example/debian-security bookworm-security main\n"),
      ("nodesource.list", "deb https://deb.nodesource.com/node_20.x nodistro main\n"),
      ("debian.sources", DEB822)], "http://mirror.example/debian"),
    ([("debian.sources", "Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\nEnabled: no\n")], None),
    ([], None),
])
def test_mirror_from_apt_sources(sources: list[tuple[str, str]], mirror: str | None) -> None:
    assert debian_mirror(sources) == mirror


def test_versions_and_roots_dir() -> None:
    assert {v: s.suite for v, s in VERSIONS.items()} == {"22.05": None, "24.11": "trixie", "26.05": "sid"}
    with pytest.raises(ConfigError, match="allowed: 22.05, 24.11, 26.05"):
        slurm_version("23.11")
    with pytest.raises(ConfigError, match="slurm_version = '25.11'"):
        ClusterSpec(slurm_version="25.11")
    assert roots_dir({"OMNI_SLURM_ROOTS": "/x"}) == Path("/x")
    assert roots_dir({}, is_root=True) == Path("/var/cache/slurm-omni/roots")
    assert roots_dir({"XDG_CACHE_HOME": "/c"}, is_root=False) == Path("/c/slurm-omni/roots")


def test_config_differences(tmp_path: Path) -> None:
    paths = ClusterPaths(tmp_path)
    old = render_slurm_conf(ClusterSpec(), paths)
    new = render_slurm_conf(ClusterSpec(slurm_version="26.05"), paths)
    assert "SwitchType=switch/none" in old and "SwitchType" not in new   # the plugin is gone after 22.05
    assert "CgroupPlugin=disabled" in render_cgroup_conf()
    assert not ClusterSpec().in_root and ClusterSpec(slurm_version="24.11").in_root


def test_first_job_id_gives_side_by_side_clusters_their_own_job_ids(tmp_path: Path) -> None:
    paths = ClusterPaths(tmp_path)
    assert "FirstJobId" not in render_slurm_conf(ClusterSpec(), paths)
    assert "FirstJobId=3001\n" in render_slurm_conf(ClusterSpec(first_job_id=3001), paths)
    with pytest.raises(ConfigError, match=r"first_job_id = 0 \(allowed: 1\.\.60000000\)"):
        ClusterSpec(first_job_id=0)


@pytest.mark.skipif(os.geteuid() != 0, reason="chroot needs root")
def test_wrapper_passes_arguments_untouched(tmp_path: Path) -> None:
    """A wrapper around /usr/bin/printf, chrooting into "/": every argument arrives as one word,
    nothing is evaluated, and the working directory is kept."""
    wrapper = tmp_path / "it's a dir" / "printf"
    wrapper.parent.mkdir()
    wrapper.write_text(render_client_wrapper(Path("/"), "printf", "test"))
    wrapper.chmod(0o755)
    evil = ["%s|", "a b", "c'd", '"e"', "$(touch pwned)", "`touch pwned`", "x\ny", "*", "--"]
    out = subprocess.run([str(wrapper), *evil], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout == "|".join(evil[1:]) + "|"
    assert not (tmp_path / "pwned").exists() and not Path("/pwned").exists()
    pwd = subprocess.run([str(wrapper), "%s", "."], capture_output=True, text=True, check=True,
                         cwd=tmp_path / "it's a dir")
    assert pwd.stdout == "."


def test_wrapper_text_quotes_the_view() -> None:
    text = render_client_wrapper(Path("/state dir/root"), "sinfo", "24.11.5")
    assert "/usr/sbin/chroot '/state dir/root' /bin/sh -c" in text and 'exec /usr/bin/sinfo "$@"' in text


def test_binds_cover_the_jobs_python(tmp_path: Path) -> None:
    project = Path(__file__).resolve().parents[2]
    binds = {b.target: b for b in job_binds(project, project / ".omni" / "cluster-x")}
    assert Path(os.path.realpath(sys.executable)) in binds        # the interpreter the venv links to
    assert any((t / "os.py").exists() for t in binds)             # its standard library
    assert binds[Path("/proc")].kind == "proc" and binds[Path("/etc/passwd")].read_only
    # the job owners' homes, where their --output files go (the multiuser tests' logs)
    assert (Path("/home") in binds) is Path("/home").is_dir()
    assert project in binds and project / ".omni" / "cluster-x" not in binds   # under the project already
    (tmp_path / "state").mkdir()
    assert tmp_path / "state" not in {b.target for b in job_binds(project, tmp_path / "state")}  # under /tmp


def test_unknown_version_flag_is_one_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "slurm_omni.cli.main", "cluster", "up", "--slurm", "25.11",
                        "--state-dir", str(tmp_path / "c")], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "25.11" in r.stderr and "24.11" in r.stderr and not (tmp_path / "c").exists()


def test_wrapper_enters_as_non_root_through_a_user_namespace() -> None:
    text = render_client_wrapper(Path("/v"), "sbatch", "26.05.5")
    assert 'exec /usr/bin/unshare --user --map-current-user --root=/v /bin/sh -c' in text
    assert text.count('"$@"') == 5   # inside the root; the inner and outer "$@" of chroot and of unshare
