"""A chain of runs: fab train's flags resolved into a request (train_flags, a --resume included), the runs
that follow one another after a preemption (restarts) and the process that supervises them (supervisor)."""
