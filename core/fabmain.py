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


def make_fab() -> Fab:
    program = make_program()
    program.loader_class = CheckoutLoader
    return program


def main() -> None:
    make_fab().run()
