"""Outputs made from runs: `fab bench` scaling reports and `fab kube` manifests."""
