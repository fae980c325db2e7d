"""From `fab train`'s flags to mpirun: the request resolved once (train_flags, request, jobflags), the nodes
probed (probe, preflight), their topology, and mpirun's argv and environment (launcher)."""
