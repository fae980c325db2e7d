"""From a request to mpirun: the request validated once (request), the nodes probed (probe, preflight), their
topology, and mpirun's argv and environment (launcher)."""
