"""Errors the CLI shows as one line (value, rule, fix) and a non-zero exit."""


class ClusterError(Exception):
    """A problem the user can fix; the message says what and how."""


class NodeFailure(ClusterError):
    """A step failed on one or more named nodes."""

    def __init__(self, message: str, nodes: list[str] | None = None, run_id: str | None = None,
                 lost: list[str] | None = None):
        super().__init__(message)
        self.nodes = list(nodes or [])
        self.run_id = run_id  # set once a run folder exists
        self.lost = list(lost or [])  # nodes that no longer answered SSH when the run was cleaned up


class Interrupted(ClusterError):
    """Ctrl-C ended the run after its clean-up: exit 130, one line saying what is left."""

    exit_code = 130
    prefix = ""


class Preempted(ClusterError):
    """A spot notice ended the run after a checkpoint came home: exit 75, one line saying how to resume."""

    exit_code = 75
    prefix = ""

    def __init__(self, message: str, run_id: str | None = None, node: str | None = None):
        super().__init__(message)
        self.run_id, self.node = run_id, node
