"""`fab train`: topology, the request and launch plan, staging, mpirun, the ranks' output, run records,
clean-up, outputs and checkpoints home, --resume and --max-restarts."""
