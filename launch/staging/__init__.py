"""What goes to the nodes and comes back: --workdir, data files and the bundled jobs' flags, users' scripts,
secrets, outputs and checkpoints home."""
