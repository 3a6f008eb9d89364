"""The embedded cluster's config for many slurmd on one host (issue 19's scale lane), pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_omni.cluster.spec import (
    MAX_NODES,
    ClusterPaths,
    ClusterSpec,
    render_slurm_conf,
    render_topology_conf,
)
from slurm_omni.errors import ConfigError


def _keys(conf: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in conf.splitlines():
        if "=" in line and not line.startswith(("#", "NodeName", "PartitionName")):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def test_a_large_cluster_gets_each_setting_once_with_more_time() -> None:
    spec = ClusterSpec(nodes=MAX_NODES, nodes_per_switch=16, hostname="h")
    conf = render_slurm_conf(spec, ClusterPaths(Path("/x")))
    keys = _keys(conf)
    assert all(len(v) == 1 for v in keys.values()), {k: v for k, v in keys.items() if len(v) > 1}
    assert (keys["MessageTimeout"], keys["SlurmdTimeout"], keys["SlurmdDebug"]) == (["100"], ["300"], ["error"])
    # what each slurmstepd and slurmctld does per node or per process is cut (docs/in-allocation.md "Scale")
    assert (keys["ProctrackType"], keys["UnkillableStepTimeout"]) == (["proctrack/pgid"], ["600"])
    assert keys["SchedulerParameters"] == ["bf_interval=30,bf_resolution=60"]
    # every node on one line, ports a range: each Slurm command parses slurm.conf, and a line per node
    # cost each one 13-25 ms of CPU at 512 nodes (issue 19)
    (line,) = [line for line in conf.splitlines() if line.startswith("NodeName=")]
    assert f"NodeName=node[1-{MAX_NODES}] " in line
    assert f" Port={spec.slurmd_base_port}-{spec.slurmd_base_port + MAX_NODES - 1} " in line
    assert spec.node_port(f"node{MAX_NODES}") == spec.slurmd_base_port + MAX_NODES - 1   # slurmd -N's place in it
    topo = render_topology_conf(spec).splitlines()
    assert sum(line.startswith("SwitchName=leaf") for line in topo) == MAX_NODES // 16
    assert topo[-1] == f"SwitchName=root Switches=leaf[1-{MAX_NODES // 16}]"


def test_a_small_cluster_keeps_its_settings() -> None:
    keys = _keys(render_slurm_conf(ClusterSpec(hostname="h"), ClusterPaths(Path("/x"))))
    assert (keys["MessageTimeout"], keys["SlurmdTimeout"], keys["SlurmdDebug"]) == (["5"], ["10"], ["info"])
    assert (keys["ProctrackType"], keys["UnkillableStepTimeout"]) == (["proctrack/linuxproc"], ["180"])


def test_the_scale_lane_gets_the_large_settings_at_every_size() -> None:
    """The scale bench's 8 and 64 nodes run under the settings of its 512 (its slopes compare like with like)."""
    keys = _keys(render_slurm_conf(ClusterSpec(nodes=8, hostname="h", scale_lane=True), ClusterPaths(Path("/x"))))
    assert all(len(v) == 1 for v in keys.values())
    assert (keys["MessageTimeout"], keys["ProctrackType"], keys["SlurmdTimeout"]) == (["100"], ["proctrack/pgid"], ["300"])


def test_more_nodes_than_one_machine_runs_is_refused() -> None:
    with pytest.raises(ConfigError, match=f"nodes = {MAX_NODES + 1} \\(allowed: 1..{MAX_NODES}"):
        ClusterSpec(nodes=MAX_NODES + 1, hostname="h")


def test_down_finds_strays_of_its_own_state_dir_only() -> None:
    # a cluster in .omni/cluster must not take the slurmstepd of .omni/cluster-scale for its own
    from slurm_omni.cluster.local import _under

    roots = ("/w/.omni/cluster", "/var/cache/roots/view/w/.omni/cluster")
    assert _under("/w/.omni/cluster/nodes/node1/spool/x", roots)
    assert _under("/var/cache/roots/view/w/.omni/cluster/etc/slurm.conf", roots)
    assert not _under("/w/.omni/cluster-scale/nodes/node1/spool/x", roots)
    assert not _under("/var/cache/roots/view/w/.omni/cluster-scale/x", roots)


def test_munged_serves_a_large_cluster_with_more_threads() -> None:
    """One munged serves every emulated node: a 256-node relaunch overflowed its 2 threads (17:33)."""
    from slurm_omni.cluster.local import LocalCluster
    from slurm_omni.cluster.spec import munged_threads

    assert munged_threads(ClusterSpec(nodes=8, hostname="h")) == []
    assert munged_threads(ClusterSpec(nodes=8, hostname="h", scale_lane=True)) == ["--num-threads=16"]
    assert munged_threads(ClusterSpec(nodes=256, nodes_per_switch=16, hostname="h")) == ["--num-threads=16"]
    big = LocalCluster(Path("/nonexistent-state"), ClusterSpec(nodes=256, nodes_per_switch=16, hostname="h"))
    munged = next(d for d in big.daemons() if d.name == "munged")
    assert "--num-threads=16" in munged.argv


def test_one_node_gets_one_port_not_a_range() -> None:
    spec = ClusterSpec(nodes=1, nodes_per_switch=1, hostname="h")
    (line,) = [line for line in render_slurm_conf(spec, ClusterPaths(Path("/x"))).splitlines()
               if line.startswith("NodeName=")]
    assert line.startswith("NodeName=node1 ") and f" Port={spec.slurmd_base_port} " in line


def test_a_large_cluster_gives_its_nodes_a_munged_of_their_own() -> None:
    """The control plane's credentials never queue behind the nodes' (spec.node_munged): slurmd reads a
    copy of slurm.conf that differs in its munged's socket alone, both munged share the key."""
    from slurm_omni.cluster.local import NODE_MUNGED, LocalCluster
    from slurm_omni.cluster.spec import node_munged

    paths = ClusterPaths(Path("/x"))
    small = ClusterSpec(nodes=8, hostname="h")
    assert not node_munged(small)
    assert "NO_CONF_HASH" not in render_slurm_conf(small, paths)
    assert render_slurm_conf(small, paths, for_nodes=True) == render_slurm_conf(small, paths)
    assert [d.name for d in LocalCluster(Path("/nonexistent-state"), small).daemons()][:2] == ["munged", "slurmctld"]

    for spec in (ClusterSpec(nodes=8, hostname="h", scale_lane=True), ClusterSpec(nodes=128, nodes_per_switch=16, hostname="h")):
        assert node_munged(spec)
        ctld, nodes = render_slurm_conf(spec, paths), render_slurm_conf(spec, paths, for_nodes=True)
        assert f"AuthInfo=socket={paths.munge_socket}\n" in ctld
        assert f"AuthInfo=socket={paths.node_munge_socket}\n" in nodes
        assert "DebugFlags=NO_CONF_HASH\n" in ctld and "DebugFlags=NO_CONF_HASH\n" in nodes
        differ = set(ctld.splitlines()) ^ set(nodes.splitlines())
        assert differ == {f"AuthInfo=socket={paths.munge_socket}", f"AuthInfo=socket={paths.node_munge_socket}"}
        daemons = {d.name: d for d in LocalCluster(Path("/s"), spec).daemons()}
        key = [a for a in daemons["munged"].argv if a.startswith("--key-file=")]
        assert key and key == [a for a in daemons[NODE_MUNGED].argv if a.startswith("--key-file=")]
        assert f"--socket={ClusterPaths(Path('/s')).node_munge_socket}" in daemons[NODE_MUNGED].argv
        assert daemons["munged"].pid_file != daemons[NODE_MUNGED].pid_file
        slurmd = daemons["slurmd:node1"].argv
        assert slurmd[slurmd.index("-f") + 1] == str(ClusterPaths(Path("/s")).node_slurm_conf)
        ctld_argv = daemons["slurmctld"].argv
        assert ctld_argv[ctld_argv.index("-f") + 1] == str(ClusterPaths(Path("/s")).slurm_conf)
