"""What the embedded cluster looks like, and the Slurm config files that describe it (pure)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from slurm_omni.cluster.versions import HOST_VERSION, VERSIONS
from slurm_omni.errors import ConfigError
from slurm_omni.slurm.hostlist import compress

DEFAULT_STATE_DIR = Path(".omni/cluster")
MAX_NODES = 512
"""The most slurmd one machine runs here (24 GiB, 2 cores: docs/in-allocation.md, "Scale")."""
LARGE = 64
"""Above this many nodes the config gives the one host's daemons more time (``large_cluster_lines``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """The embedded cluster: ``nodes`` slurmd daemons on 127.0.0.1 under a two-level switch tree."""

    nodes: int = 8
    """How many nodes (one ``slurmd -N nodeX`` each)."""
    nodes_per_switch: int = 4
    """Nodes under each leaf switch; the leaf switches hang under one root switch."""
    gres_type: str = "h100"
    """Type of the fake GPUs (``gpu:<type>:<count>``)."""
    gpus_per_node: int = 4
    """Fake GPUs per node, each a character device made with mknod."""
    cpus_per_node: int = 4
    """CPUs each node declares (trusted by slurmd: SlurmdParameters=config_overrides)."""
    memory_mb: int = 4096
    """RealMemory of each node."""
    partitions: tuple[str, ...] = ("vision", "text")
    """Partitions for the stages; each spans every node, and ``debug`` is the default."""
    node_prefix: str = "node"
    ctld_port: int = 16817
    """slurmctld's port; slurmd ports follow from ``slurmd_base_port``."""
    slurmd_base_port: int = 16900
    first_job_id: int = 1
    """The first job id slurmctld hands out (``FirstJobId``). Job scripts derive their rendezvous port
    from the job id, so two clusters on one machine running at once need ranges that don't overlap."""
    slurmd_timeout_s: int = 10
    """How long a silent slurmd stays NOT_RESPONDING before slurmctld sets it DOWN."""
    cluster_name: str = "omni"
    slurm_version: str = HOST_VERSION
    """Which Slurm runs the cluster: 22.05 (the host's packages), 24.11 or 26.05 (from a Debian root)."""
    hostname: str = field(default_factory=socket.gethostname)
    scale_lane: bool = False
    """The scale lane's settings (:data:`LARGE_SETTINGS`) at any size, so that its sizes compare
    (``bench/scale_bench.py``); they apply above :data:`LARGE` nodes anyway."""

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.nodes <= MAX_NODES, f"nodes = {self.nodes} (allowed: 1..{MAX_NODES} on one machine)"),
            (1 <= self.nodes_per_switch <= self.nodes,
             f"nodes_per_switch = {self.nodes_per_switch} (allowed: 1..nodes)"),
            (0 <= self.gpus_per_node <= 16, f"gpus_per_node = {self.gpus_per_node} (allowed: 0..16)"),
            (1 <= self.cpus_per_node <= 256, f"cpus_per_node = {self.cpus_per_node} (allowed: 1..256)"),
            (self.gres_type.isidentifier(), f"gres_type = {self.gres_type!r} (allowed: letters, digits, _)"),
            (all(p.isidentifier() for p in self.partitions) and "debug" not in self.partitions,
             f"partitions = {list(self.partitions)} (allowed: identifiers other than 'debug')"),
            (1024 < self.ctld_port < 65000 and 1024 < self.slurmd_base_port < 65000 - self.nodes,
             f"ports = {self.ctld_port}, {self.slurmd_base_port} (allowed: 1025..64999)"),
            (1 <= self.first_job_id <= 60_000_000,
             f"first_job_id = {self.first_job_id} (allowed: 1..60000000)"),
            (self.slurm_version in VERSIONS,
             f"slurm_version = {self.slurm_version!r} (allowed: {', '.join(VERSIONS)})"),
            (self.slurmd_timeout_s >= 3, f"slurmd_timeout_s = {self.slurmd_timeout_s} (allowed: >= 3)"),
        ]
        for ok, what in checks:
            if not ok:
                raise ConfigError(f"cluster: bad {what}")

    @property
    def node_names(self) -> list[str]:
        return [f"{self.node_prefix}{i}" for i in range(1, self.nodes + 1)]

    @property
    def in_root(self) -> bool:
        """Runs from a Debian root (chroot) rather than the host's packages."""
        return VERSIONS[self.slurm_version].suite is not None

    @property
    def leaf_switches(self) -> dict[str, list[str]]:
        names = self.node_names
        size = self.nodes_per_switch
        return {f"leaf{j + 1}": names[i:i + size] for j, i in enumerate(range(0, len(names), size))}

    def node_port(self, name: str) -> int:
        return self.slurmd_base_port + self.node_names.index(name)


@dataclass(frozen=True, slots=True)
class ClusterPaths:
    """Where everything of one embedded cluster lives, below its state directory."""

    root: Path

    @property
    def etc(self) -> Path: return self.root / "etc"
    @property
    def slurm_conf(self) -> Path: return self.etc / "slurm.conf"
    @property
    def munge_dir(self) -> Path: return self.root / "munge"
    @property
    def munge_socket(self) -> Path: return self.munge_dir / "munge.socket"
    @property
    def node_munge_socket(self) -> Path: return self.munge_dir / "munge-nodes.socket"
    @property
    def node_slurm_conf(self) -> Path: return self.etc / "slurm-nodes.conf"
    @property
    def munge_key(self) -> Path: return self.munge_dir / "munge.key"
    @property
    def ctld_dir(self) -> Path: return self.root / "ctld"
    @property
    def spool(self) -> Path: return self.root / "spool"
    @property
    def dev(self) -> Path: return self.root / "dev"
    @property
    def record(self) -> Path: return self.root / "cluster.json"
    @property
    def bin(self) -> Path: return self.root / "bin"
    @property
    def plugin(self) -> Path: return self.root / "spank" / "omni_spank.so"

    def node_dir(self, node: str) -> Path:
        return self.root / "nodes" / node

    def gpu_files(self, node: str, count: int) -> list[Path]:
        return [self.dev / node / f"gpu{i}" for i in range(count)]


def render_slurm_conf(spec: ClusterSpec, paths: ClusterPaths, *, for_nodes: bool = False) -> str:
    """slurm.conf; ``for_nodes``: the copy the slurmd read where the nodes have a munged of their own
    (:func:`node_munged`), the same but for that munged's socket."""
    root = paths.root
    socket_path = paths.node_munge_socket if for_nodes and node_munged(spec) else paths.munge_socket
    nodes = compress(spec.node_names)
    gres = f" Gres=gpu:{spec.gres_type}:{spec.gpus_per_node}" if spec.gpus_per_node else ""
    lines = [
        "# Generated by slurm-omni (omni cluster up); edits are overwritten.",
        f"ClusterName={spec.cluster_name}",
        f"SlurmctldHost={spec.hostname}(127.0.0.1)",
        f"SlurmctldPort={spec.ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={socket_path}",
        # The nodes' copy differs in its munged's socket alone: slurmctld would log every node's
        # registration as a config mismatch.
        *(["DebugFlags=NO_CONF_HASH"] if node_munged(spec) else []),
        f"StateSaveLocation={paths.ctld_dir / 'state'}",
        f"SlurmctldPidFile={paths.ctld_dir / 'slurmctld.pid'}",
        f"SlurmctldLogFile={paths.ctld_dir / 'slurmctld.log'}",
        f"SlurmdSpoolDir={root / 'nodes' / '%n' / 'spool'}",
        f"SlurmdPidFile={root / 'nodes' / '%n' / 'slurmd.pid'}",
        f"SlurmdLogFile={root / 'nodes' / '%n' / 'slurmd.log'}",
        "SlurmdParameters=config_overrides",
        f"PlugStackConfig={paths.etc / 'plugstack.conf'}",
        # No cgroups in containers and CI: track processes by parentage.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        *(["SwitchType=switch/none"] if spec.slurm_version == "22.05" else []),  # gone after 22.05
        # Heterogeneous jobs are started only by the backfill scheduler (Slurm 22.05).
        "SchedulerType=sched/backfill",
        "SchedulerParameters=bf_interval=1,bf_resolution=1",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "GresTypes=gpu",
        "TopologyPlugin=topology/tree",
        "JobRequeue=1",
        *([f"FirstJobId={spec.first_job_id}"] if spec.first_job_id != 1 else []),
        # 1: a node DOWN for not responding returns when its slurmd registers; one set DOWN by an
        # admin (or a drill) stays DOWN until resumed.
        "ReturnToService=1",
        f"SlurmdTimeout={spec.slurmd_timeout_s}",
        "SlurmctldTimeout=30",
        "MessageTimeout=5",
        "InactiveLimit=0",
        "KillWait=5",
        # Slurm drains a node whose step's processes outlive this after SIGKILL ("Kill task
        # failed"); default 60 s. Eight slurmd on one loaded 2-core host met it (a torch rank in
        # D state at load 35 left node5 drained for every later test): 3 minutes.
        "UnkillableStepTimeout=180",
        "MinJobAge=120",
        "TCPTimeout=2",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    override = dict(line.split("=", 1) for line in large_cluster_lines(spec))
    lines = [f"{k}={override.pop(k)}" if (k := line.split("=", 1)[0]) in override else line for line in lines]
    lines += [f"{k}={v}" for k, v in override.items()]
    # One line for every node, their ports a range (node i listens on base + i - 1): every Slurm
    # command parses slurm.conf, and 512 lines of one per node cost each call 13-25 ms of CPU more
    # than 64 (sinfo, scontrol, squeue; 2026-12-03, Slurm 22.05), the emulation's own growth (a site
    # writes its nodes as ranges). slurmd -N finds its port by its place in the range.
    ports = (f"{spec.slurmd_base_port}-{spec.slurmd_base_port + spec.nodes - 1}" if spec.nodes > 1
             else str(spec.slurmd_base_port))
    lines.append(
        f"NodeName={nodes} NodeHostname={spec.hostname} NodeAddr=127.0.0.1 "
        f"Port={ports} CPUs={spec.cpus_per_node} RealMemory={spec.memory_mb}{gres} State=UNKNOWN"
    )
    lines.append(f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP")
    for part in spec.partitions:
        lines.append(f"PartitionName={part} Nodes={nodes} MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


LARGE_SETTINGS: tuple[tuple[str, str, str], ...] = (
    ("MessageTimeout", "100", ("a message answered late is the one host's load, not a lost node; srun's task launch "
                               "waits this long for each slurmd: a 512-node relaunch's first task started 57 s after "
                               "srun (05:03), and at 08:08 48 nodes answered after 60 s ('Task launch ... failed: "
                               "Socket timed out'), srun aborted the launch")),
    ("TCPTimeout", "10", "connections to 512 slurmd on 2 shared cores open slowly"),
    ("SlurmdTimeout", "300", ("slurmctld pings every slurmd each SlurmdTimeout/3: one ping round per 100 s "
                              "instead of per 20 s (512 RPCs a round); the lane sets nodes DOWN itself, never "
                              "waits for a silent one")),
    ("UnkillableStepTimeout", "600", ("a SIGKILLed step's 2,044 tasks take longer than 60 s to go at load "
                                      "500+: slurmd drained 432 nodes 'Kill task failed' in the last 512 run")),
    ("ProctrackType", "proctrack/pgid", ("a step's tasks by their process group (killpg): proctrack/linuxproc "
                                         "reads every /proc/PID/stat of the host for each signal and each wait, "
                                         "512 slurmstepd x 3,000 processes; pgid still reads them all once per "
                                         "SIGKILL and step end (16 nodes' step of 64 tasks: 0.52 CPU s, 1.13 with "
                                         "3,000 idle processes on the host); proctrack/cgroup's freezer took "
                                         "0.45 / 0.70 s but left a killed step's slurmstepd stuck in 2 of 20 "
                                         "64-node runs (22:45-23:27; the cause not found), so it is not used")),
    ("SchedulerParameters", "bf_interval=30,bf_resolution=60", ("backfill walks every node: every 30 s, not "
                                                                "every second (the lane's jobs start at submission "
                                                                "by the main scheduler; no heterogeneous jobs)")),
    ("SlurmctldDebug", "error", "512 slurmd log to the disk the job's files are on"),
    ("SlurmdDebug", "error", "same"),
)
"""Settings for many slurmd on one host (more than :data:`LARGE`), over the defaults: (key, value,
why). The scale bench prints them with their reasons."""


def large_cluster_lines(spec: ClusterSpec) -> list[str]:
    """:data:`LARGE_SETTINGS` as ``Key=Value`` lines for a cluster of more than :data:`LARGE` nodes.

    Every slurmd, slurmstepd and task shares the same few cores: time is load, not failure
    (MessageTimeout, TCPTimeout, SlurmdTimeout, UnkillableStepTimeout), and what slurmctld and every
    slurmstepd do per node or per process is cut (fewer pings, no /proc walks, backfill rarely).
    TreeWidth stays Slurm's (messages to the nodes fan out through slurmd's tree)."""
    if spec.nodes <= LARGE and not spec.scale_lane:
        return []
    return [f"{key}={max(int(value), spec.slurmd_timeout_s) if key == 'SlurmdTimeout' else value}"
            for key, value, _ in LARGE_SETTINGS]


MUNGED_THREADS = 16
"""munged's threads for a cluster of more than :data:`LARGE` nodes (its default is 2). One munged serves
every emulated node (a cluster has one per node), and its listen backlog is 256 (compiled in): at 256
nodes a relaunch's slurmstepd, all asking at once, overflowed it ("Munge encode failed: ... Resource
temporarily unavailable", "If munged is up, restart with --num-threads=10"), tasks were never
started and the launch failed (scale bench, 17:33)."""


def munged_threads(spec: ClusterSpec) -> list[str]:
    """munged's ``--num-threads`` for a large cluster (:data:`MUNGED_THREADS`), else nothing."""
    return [] if spec.nodes <= LARGE and not spec.scale_lane else [f"--num-threads={MUNGED_THREADS}"]


def node_munged(spec: ClusterSpec) -> bool:
    """The nodes' slurmd and slurmstepd use a munged of their own (``ClusterPaths.node_munge_socket``,
    read from ``slurm-nodes.conf``), the control plane (slurmctld, and srun, scontrol and the rest where
    the job's environment points, ``slurm.conf``) another, both with the one key: on a cluster each host
    has its munged, and no credential the control plane asks for waits behind the nodes'. With one munged
    for 512 emulated nodes a node loss's teardown (511 slurmstepd signalling their tasks and reporting
    2,044 task exits to srun) queued the supervisor's read of the lost node behind it: the read reached
    slurmctld 122 ms after it was asked while slurmctld answered in 1 ms, and munged's threads sat 403 ms
    on the run queue (summed) in those 156 ms (scale bench ``--trace-ctld``, 2026-12-03 22:50). A large
    cluster and the scale lane only (as :func:`munged_threads`): 8 nodes never queued there."""
    return spec.nodes > LARGE or spec.scale_lane


def render_cgroup_conf() -> str:
    # slurmd 26.05 refuses to start without a cgroup filesystem ("No filesystem mounted on
    # /sys/fs/cgroup") unless told there is none; the plugins chosen above need no cgroups.
    return "# Generated by slurm-omni: no cgroups in containers and CI.\nCgroupPlugin=disabled\n"


def render_topology_conf(spec: ClusterSpec) -> str:
    leaves = spec.leaf_switches
    lines = ["# Generated by slurm-omni: leaf switches under one root switch."]
    lines += [f"SwitchName={leaf} Nodes={compress(nodes)}" for leaf, nodes in leaves.items()]
    if len(leaves) > 1:
        lines.append(f"SwitchName=root Switches={compress(leaves)}")
    return "\n".join(lines) + "\n"


def render_gres_conf(spec: ClusterSpec, paths: ClusterPaths) -> str:
    lines = ["# Generated by slurm-omni: fake GPUs on character devices (gres/gpu drops file-less GPUs).",
             "AutoDetect=off"]
    if spec.gpus_per_node:
        for name in spec.node_names:
            files = paths.dev / name / f"gpu[0-{spec.gpus_per_node - 1}]"
            lines.append(f"NodeName={name} Name=gpu Type={spec.gres_type} File={files}")
    return "\n".join(lines) + "\n"


def render_plugstack_conf(plugin: Path | None, paths: ClusterPaths) -> str:
    """The SPANK stack: our plugin once it is built (re-rendered by every ``omni cluster up``)."""
    if plugin is None:
        return "# Generated by slurm-omni: no SPANK plugin built yet (make -C spank; omni cluster up).\n"
    # "optional": a plugin removed later must not stop every srun and sbatch.
    return f"# Generated by slurm-omni.\noptional {plugin} spool={paths.spool}\n"
