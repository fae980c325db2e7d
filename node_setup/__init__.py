"""Operator-side library: inventory, local cluster, keys, launching jobs over Fabric."""
