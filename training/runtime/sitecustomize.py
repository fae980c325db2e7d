# On PYTHONPATH for every rank: line-buffered output, so mpirun's per-line rank prefixes stay
# whole (unbuffered output splits print() into two writes) and nothing waits in a buffer.
import sys

for _stream in (sys.stdout, sys.stderr):
    try:
        _stream.reconfigure(line_buffering=True)
    except (AttributeError, ValueError):
        pass
