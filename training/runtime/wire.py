"""What ranks and launch agree on besides paths and events: the values of the flags that both sides check."""
from __future__ import annotations

COMM_HOOKS = ("none", "bf16", "fp16")  # what fab train --comm-hook accepts
