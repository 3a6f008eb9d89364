"""Pure parsers of ``scontrol show`` text (Slurm 22.05 has no ``scontrol --json``), and of the node
lines of ``sinfo`` that a relaunch reads (:data:`SINFO_NODE_LINES`)."""

from __future__ import annotations

import re

from slurm_omni.errors import SlurmError
from slurm_omni.slurm.gres import parse_gres
from slurm_omni.slurm.hostlist import expand
from slurm_omni.slurm.states import node_state, split_node_state
from slurm_omni.slurm.types import Node, Switch, Topology

# Key=Value pairs; a value runs to the next " Key=" (values such as Reason= and OS= hold spaces).
_PAIR = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=(.*?)(?=\s+[A-Za-z][A-Za-z0-9_/:]*=|\s*$)", re.DOTALL)


def parse_records(text: str, first_key: str) -> list[dict[str, str]]:
    """Split ``scontrol show`` output into records, each starting at ``first_key=``."""
    records: list[dict[str, str]] = []
    for block in re.split(rf"(?m)^(?={re.escape(first_key)}=)", text):
        if not block.strip():
            continue
        if not block.startswith(f"{first_key}="):
            raise SlurmError(f"scontrol: couldn't parse output: expected {first_key}=, got {block[:60]!r}")
        record: dict[str, str] = {}
        for line in block.splitlines():
            line = line.strip()
            if line.startswith("Reason="):  # the rest of the line, spaces and '=' included
                record["Reason"] = line[len("Reason="):]
                continue
            for key, value in _PAIR.findall(line):
                record[key] = value.strip()
        records.append(record)
    return records


def parse_topology(text: str) -> Topology:
    """``scontrol show topology`` -> Topology."""
    switches: dict[str, Switch] = {}
    for rec in parse_records(text, "SwitchName"):
        try:
            name, level = rec["SwitchName"], int(rec.get("Level", "0"))
        except (KeyError, ValueError) as e:
            raise SlurmError(f"scontrol: couldn't parse topology record {rec!r}") from e
        children = tuple(expand(rec["Switches"])) if rec.get("Switches") not in (None, "", "(null)") else ()
        # A leaf lists its own nodes; an upper switch lists every node below it, which we do not repeat.
        nodes = tuple(expand(rec["Nodes"])) if not children and rec.get("Nodes") not in (None, "", "(null)") else ()
        switches[name] = Switch(name=name, level=level, nodes=nodes, switches=children,
                                link_speed=int(rec.get("LinkSpeed", "1") or 1))
    return Topology(switches)


def parse_nodes(text: str, topology: Topology | None = None) -> list[Node]:
    """``scontrol show node`` -> nodes (the switch path filled in from ``topology`` when given)."""
    return nodes_from_records(parse_records(text, "NodeName"), topology)


def nodes_from_records(records: list[dict[str, str]], topology: Topology | None = None) -> list[Node]:
    """:func:`parse_nodes` of records :func:`parse_records` split already (a caller that also needs
    other keys parses the text once: 512 nodes' records cost 14 ms of CPU per parse)."""
    nodes = []
    for rec in records:
        name = rec["NodeName"]
        base, flags = split_node_state(rec.get("State", "UNKNOWN"))
        reason = rec.get("Reason", "")
        reason = re.sub(r"\s*\[[^\]]*@[^\]]*\]\s*$", "", reason)  # drop the " [user@time]" stamp
        nodes.append(Node(
            name=name,
            state=node_state(base, flags),
            slurm_state=rec.get("State", "UNKNOWN"),
            flags=flags,
            reason=reason,
            gres=parse_gres(rec.get("Gres", "")),
            partitions=tuple(p for p in rec.get("Partitions", "").split(",") if p),
            cpus=int(rec.get("CPUTot", "0") or 0),
            switch_path=topology.switch_path(name) if topology else (),
        ))
    return nodes


SINFO_NODE_LINES = "NodeList:0|,StateComplete:0|,CPUs:0|,Gres:0|,Partition:0|,Reason:0"
"""``sinfo --noheader --Node --nodes=NAMES --Format=...``: one line per node and partition the node is
in; the reason last, since it may hold the separator. Given a suffix, sinfo 22.05 neither pads nor cuts
a field. The state is sinfo's own, not slurmctld's: sinfo prints a node whose CPUs it counts as partly
allocated ``mixed`` whatever its base state (only a drained node keeps it; flags stay, ``*`` too), and
for a node set DOWN under a job that count lags (slurmctld recounts allocated CPUs for a whole read
only, not for a one-node read: ``_slurm_rpc_dump_node_single``; ``slurm/csrc/node_read.c``): the lines of ``sinfo_one_node_down_under_job.txt``
(22.05, recorded 15 ms after srun's "Node failure on node2", beside ``scontrol show node``'s
``State=DOWN CPUAlloc=0`` of the same moment, ``node_down_under_job.txt``) say ``mixed`` with the
DOWN's reason, and ``--states=down`` prints nothing. So a node srun reports failed is read with
``scontrol show node`` (the one-node ``sinfo`` read of issue 19 was withdrawn: its usable answer
ended srun's report and the demo's node loss waited 1.4 s for the step's teardown)."""


def nodes_from_sinfo(text: str, topology: Topology | None = None) -> list[Node]:
    """:data:`SINFO_NODE_LINES`'s lines -> nodes, as :func:`nodes_from_records` makes them from
    ``scontrol show node`` (its lines of one node merged: their partitions)."""
    by_name: dict[str, list[str]] = {}
    parts: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|", 5)
        if len(fields) != 6 or not fields[0] or not fields[1]:
            raise SlurmError(f"sinfo: couldn't parse a node line: {line[:80]!r} (expected 6 fields separated by |)")
        by_name.setdefault(fields[0], fields)
        part = fields[4].rstrip("*")   # the default partition's mark
        if part and part not in parts.setdefault(fields[0], []):
            parts[fields[0]].append(part)
    records = []
    for name, (_, state, cpus, gres, _, reason) in by_name.items():
        records.append({"NodeName": name, "State": state.upper(), "CPUTot": cpus if cpus.isdigit() else "0",
                        "Gres": "" if gres == "(null)" else gres, "Partitions": ",".join(parts.get(name, [])),
                        "Reason": "" if reason.strip() == "none" else reason.strip()})
    return nodes_from_records(records, topology)


_SALLOC_JOB = re.compile(r"^salloc: (?:Pending|Granted) job allocation (\d+)\s*$", re.MULTILINE)


def parse_salloc_job_id(text: str) -> int | None:
    """The job id in what ``salloc`` printed ("salloc: Pending job allocation 2001", then "Granted
    job allocation 2001" on 22.05 to 26.05; with ``--no-shell`` it leaves once granted), or None."""
    m = _SALLOC_JOB.search(text)
    return int(m[1]) if m else None
