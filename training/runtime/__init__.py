"""The contract between launch and the ranks: run-folder paths and checkpoints, the store, spot notices and
the rank hook's parts. The only part of training/ that the operator side imports; stdlib only at import."""
