"""What goes to the nodes and comes back: --workdir, data files, users' scripts, secrets, the store's
environment, the ranks' output stream, outputs and checkpoints home."""
