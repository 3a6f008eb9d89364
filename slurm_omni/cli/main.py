"""Entry point of ``omni``.

Sub-commands are imported lazily (torch takes seconds to import; ``omni cluster status`` must not
pay for it). Each entry names ``module:attribute`` of a click command or group.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys

import click

from slurm_omni import __version__
from slurm_omni.errors import OmniError

COMMANDS: dict[str, str] = {
    "cluster": "slurm_omni.cli.cluster:cluster",
    "ckpt": "slurm_omni.cli.ckpt:ckpt",
    "train": "slurm_omni.cli.train:train",
    "data": "slurm_omni.cli.data:data",
    "render": "slurm_omni.cli.submit:render",
    "submit": "slurm_omni.cli.submit:submit",
    "config": "slurm_omni.cli.config:config",
    "manager": "slurm_omni.cli.manager:manager",
    "status": "slurm_omni.cli.manager:status",
    "drill": "slurm_omni.cli.drill:drill",
    "report": "slurm_omni.cli.report:report",
    "demo": "slurm_omni.cli.demo:demo",
    "supervise": "slurm_omni.cli.supervise:supervise",
    "standby": "slurm_omni.cli.standby:standby",
    "launch-failure": "slurm_omni.cli.launch_failure:launch_failure",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if self._module_exists(name))

    @staticmethod
    def _module_exists(name: str) -> bool:
        module = COMMANDS[name].split(":")[0]
        return importlib.util.find_spec(module) is not None

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None or not self._module_exists(cmd_name):
            return None
        module_name, attr = target.split(":")
        command = getattr(importlib.import_module(module_name), attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{target} is not a click command")
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="slurm-omni")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """slurm-omni: multimodal LLM training that survives failures on Slurm."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    if os.environ.get("OMNI_LOG_LEVEL"):
        level = getattr(logging, os.environ["OMNI_LOG_LEVEL"].upper(), level)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="omni", standalone_mode=False)
    except OmniError as e:
        click.echo(f"omni: {e}", err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("omni: aborted", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
