"""Contract values, one home each: paths on the nodes, ports, limits, EC2 tag names.

training/ runs on the nodes and ships without this package: the values it needs reach it through
the ranks' environment (XC_HOME, MASTER_PORT, ...), set from here by the launcher.
"""
from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# On a real node: the venv every profile installs (unless it names another) and the work root.
REMOTE_VENV = "/opt/xeon-cluster/venv"
REMOTE_PYTHON = REMOTE_VENV + "/bin/python"
REMOTE_HOME = ".xeon-cluster"  # under the connecting user's home
# The work root as a shell word: each local-cluster node has its own $XC_HOME, a real node $HOME/.xeon-cluster.
HOME_EXPR = '"${XC_HOME:-$HOME/' + REMOTE_HOME + '}"'
DEFAULT_MASTER_PORT = 29500  # the rendezvous port on node 0 unless --master-port says otherwise
MAX_NODES = 64  # of a local cluster, and of a stack's nodeCount

# EC2 tags written by infra.nodes and read back by cluster.aws: the contract between them.
TAG_PREFIX = "xeon-cluster:"
TAG_CLUSTER = TAG_PREFIX + "cluster"
TAG_STACK = TAG_PREFIX + "stack"
TAG_ROLE = TAG_PREFIX + "role"
TAG_SSH_USER = TAG_PREFIX + "ssh-user"
TAG_PROFILE = TAG_PREFIX + "profile"
TAG_HOST_KEY = TAG_PREFIX + "host-key:"  # + key type: the node's own host public key (node_setup/publish_host_keys.py)
TAG_IMAGE_BUILD = TAG_PREFIX + "image-build"  # on Image Builder's build instance, which is no node
TAG_IMAGE = TAG_PREFIX + "image"  # on every node: bake | base | ami, how its software got there (restarts.py)
TAG_STORE = TAG_PREFIX + "store"  # on the cluster's Auto Scaling groups: the store bucket they write (fab sweep)
