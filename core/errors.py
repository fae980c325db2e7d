"""Errors the CLI shows as one line ('error: what; fix') and a non-zero exit.

An error carries what went wrong and how to fix it as attributes; code that must tell failures apart
catches a subclass or reads an attribute, never the message text. `format_error` is the one place that
turns an error into the line the user sees."""
from __future__ import annotations


class ClusterError(Exception):
    """A problem the user can fix: ClusterError(what, fix=...). The two are kept apart from where the error is
    made to where it is shown; nothing splits or parses the text."""

    exit_code = 1
    prefix = "error: "

    def __init__(self, what: str, fix: str | None = None):
        self.what, self.fix = str(what), fix or ""
        super().__init__(self.text)

    @property
    def text(self) -> str:
        return f"{self.what}; {self.fix}" if self.fix else self.what

    def __str__(self) -> str:
        return self.text


class NodeFailure(ClusterError):
    """A step failed on one or more named nodes; `errors` keeps each node's own exception (fan-out)."""

    def __init__(self, message: str, nodes: list[str] | None = None, run_id: str | None = None,
                 lost: list[str] | None = None, errors: dict[str, BaseException] | None = None,
                 fix: str | None = None):
        super().__init__(message, fix)
        self.nodes = list(nodes or [])
        self.run_id = run_id  # set once a run folder exists
        self.lost = list(lost or [])  # nodes that no longer answered SSH when the run was cleaned up
        self.errors = dict(errors or {})


class NodeLost(NodeFailure):
    """A run ended because nodes stopped answering: waiting for the cluster to have them again can help."""


class Unreachable(ClusterError):
    """A node did not answer SSH (down, or not allowed from here)."""

    def __init__(self, what: str, fix: str | None = None, node: str | None = None):
        super().__init__(what, fix)
        self.node = node


class HostKeyUnknown(ClusterError):
    """The node's host key is not in any known_hosts file this cluster uses."""


class NoRecord(ClusterError):
    """A run folder without a readable summary.json."""


class NoCheckpoint(ClusterError):
    """A run has no complete checkpoint at home to resume from."""


class PortHeld(ClusterError):
    """A TCP port the run needs is held by another process on a node."""


class Interrupted(ClusterError):
    """Ctrl-C ended the run after its clean-up: exit 130, one line saying what is left."""

    exit_code = 130
    prefix = ""


class Preempted(ClusterError):
    """A spot notice ended the run after a checkpoint came home: exit 75, one line saying how to resume."""

    exit_code = 75
    prefix = ""

    def __init__(self, message: str, run_id: str | None = None, node: str | None = None, fix: str | None = None):
        super().__init__(message, fix)
        self.run_id, self.node = run_id, node


def format_error(exc: ClusterError) -> str:
    """The line the CLI prints for an error: the one formatter."""
    return f"{exc.prefix}{exc.text}"
