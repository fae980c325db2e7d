"""`fab doctor`: pure rules, per-node and cross-node rows, the rendezvous port and the all-reduce."""
