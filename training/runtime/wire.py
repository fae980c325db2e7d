"""What ranks and launch agree on besides paths: the tags of the lines launch reads from a rank's output, and
the values of the flags that both sides check."""
from __future__ import annotations

PROGRESS_TAG = "[progress]"
# Every rank prints this as its last act: a crash after it (oneCCL's teardown at exit) loses nothing.
FINISHED_TAG = "[finished]"

COMM_HOOKS = ("none", "bf16", "fp16")  # what fab train --comm-hook accepts
