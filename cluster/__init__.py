"""The operator's view of a cluster: nodes and where they come from (local, hosts, aws, pulumi), the
local sshd cluster, SSH sessions and fan-out, keys and host keys, shipping the training code."""
