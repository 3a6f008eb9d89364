"""One error family for the whole tool.

Messages read ``component: couldn't X: value (hint)``. The CLI prints one line and exits
non-zero; nothing below it prints tracebacks for user errors.
"""

from __future__ import annotations


class OmniError(Exception):
    """Base of every error slurm-omni raises on purpose."""

    exit_code = 1


class ConfigError(OmniError):
    """A config, job or site file holds an unknown key or a bad value."""

    exit_code = 2


class SlurmError(OmniError):
    """A Slurm command failed, or its output could not be understood."""


class SlurmUnreachable(SlurmError):
    """slurmctld did not answer within the retry budget."""


class ClusterError(OmniError):
    """The embedded local cluster could not be brought up, inspected or stopped."""


class CheckpointError(OmniError):
    """A checkpoint is missing, incomplete or corrupt."""


class StorageFull(CheckpointError):
    """The checkpoint file system is full (or over quota): no restart helps until space is freed, so a
    training rank exits 78 (``slurm_omni.elastic.codes.EXIT_BAD_INPUT``) and the job stops."""

    exit_code = 78


class RuntimeLayoutError(OmniError):
    """The training runtime's environment does not describe a valid layout."""
