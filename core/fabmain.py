"""The `fab` command this project installs: Fabric's own program, except where it finds the tasks.

Fabric looks for fabfile.py in the current folder and above it only, so from a user's own repository it finds
none ("Can't find any collection named 'fabfile'"). This `fab` then loads the checkout's fabfile (and its
fabric.yaml), so `fab train --workdir . --script train.py` works there and finds the cluster the checkout started.
A fabfile.py at or above the current folder still wins, as with Fabric's `fab`; `-r DIR` and `-c NAME` are
Fabric's too.
"""
from __future__ import annotations

from fabric.main import Fab, make_program
from invoke.exceptions import CollectionNotFound
from invoke.loader import FilesystemLoader
from invoke.parser import parser as invoke_parser

from core.constants import PROJECT_ROOT


class CheckoutLoader(FilesystemLoader):
    """Fabric's loader, with this checkout's fabfile where the search from the current folder finds none."""

    def find(self, name: str):
        try:
            return super().find(name)
        except CollectionNotFound:  # what the search raises once it reaches / with nothing found
            if name != "fabfile" or self._start:  # -c NAME, or -r DIR (tasks.search_root): Fabric's answer
                raise
        return FilesystemLoader(start=str(PROJECT_ROOT), config=self.config).find(name)


HELP = ("--help", "-h")


def help_anywhere() -> None:
    """`fab TASK --help` shows the task's help even where the task takes a positional argument: invoke's parse
    machine would take `--help` as its value (`fab local-notice --help`: "no local node '--help'"). Its machine is
    a fluidity state machine, which cannot be subclassed, so its two methods are wrapped, once."""
    machine = invoke_parser.ParseMachine
    if getattr(machine, "_xc_help_anywhere", False):
        return
    handle, complete = machine.handle, machine.complete_context

    def handle_help(self, token: str) -> None:
        if (token in HELP and self.current_state != "unknown" and self.initial and token in self.initial.flags
                and self.context is not None and self.context is not self.initial and self.context.name
                and not self.waiting_for_flag_value):
            self.initial.flags[token].value = self.context.name
            return
        handle(self, token)

    def complete_for_help(self) -> None:
        if (self.context is not None and self.context is not self.initial and self.initial
                and self.context.name and self.initial.args.help.value == self.context.name):
            if self.context not in self.result:  # only its help runs: no positional argument is needed
                self.result.append(self.context)
            return
        complete(self)

    machine.handle, machine.complete_context, machine._xc_help_anywhere = handle_help, complete_for_help, True


def make_fab() -> Fab:
    program = make_program()
    program.loader_class = CheckoutLoader
    help_anywhere()
    return program


def main() -> None:
    make_fab().run()
