"""The contract between launch and the ranks: run-folder paths and checkpoints, the store, spot notices and
the rank hook's parts. The only part of training/ that the operator side imports; stdlib only at import."""

# What the operator side (launch, cluster, twin, sweep, doctor, infra, reports, node_setup, core, fabfile) imports from
# training: these names and no other (tests/project/test_layout.py holds it to them). A module named here is reached
# through its name (store.open_store, spot.cluster_env), never imported from piecemeal.
CONTRACT = ("paths.RunPaths", "paths.Checkpoints", "notice.Notice", "events", "store", "spot", "timeline", "snapshot",
            "pylayer", "spec.RunSpec")
