"""ClusterSettings, the catalog and Pulumi.yaml: every rule fails with one line naming the key."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from core import catalog
from core.errors import ClusterError
from infra.settings import CONFIG_KEYS, ClusterSettings

ROOT = Path(__file__).resolve().parents[2]
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOp9fX1kZXZlbG9wZXIta2V5LWZvci10ZXN0cw operator@laptop"
REQUIRED = {"adminCidr": "203.0.113.7/32", "sshPublicKey": KEY}


def settings(**config) -> ClusterSettings:
    return ClusterSettings.from_config({**REQUIRED, **config}, stack="dev")


def test_defaults_are_a_valid_spot_cluster():
    s = settings()
    assert (s.cluster_name, s.availability_zone, s.node_count, s.spot, s.image) == ("dev", "us-east-1a", 4, True, "bake")
    assert s.capacity_rebalance is False and settings(capacityRebalance="true").capacity_rebalance is True
    assert s.instance.amx and s.tags == {"xeon-cluster:cluster": "dev", "xeon-cluster:stack": "dev"}


def test_strings_from_pulumi_are_parsed_into_types():
    s = settings(nodeCount="8", spot="false", rootVolumeGib="250", allowWorldSsh="true", adminCidr="0.0.0.0/0",
                 region="eu-west-1", availabilityZone="eu-west-1b", clusterName="bert-8", image="ami-0123456789abcdef0")
    assert (s.node_count, s.spot, s.root_volume_gib, s.allow_world_ssh) == (8, False, 250, True)
    assert (s.cluster_name, s.availability_zone, s.image) == ("bert-8", "eu-west-1b", "ami-0123456789abcdef0")


@pytest.mark.parametrize("config, key, fix", [
    ({"adminCidr": ""}, "adminCidr", "pulumi config set adminCidr"),
    ({"adminCidr": "0.0.0.0/0"}, "adminCidr", "allowWorldSsh true"),
    ({"adminCidr": "203.0.113.7/24"}, "adminCidr", "pulumi config set adminCidr"),
    ({"adminCidr": "my-laptop"}, "adminCidr", "pulumi config set adminCidr"),
    ({"sshPublicKey": ""}, "sshPublicKey", "id_ed25519.pub"),
    ({"sshPublicKey": "-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn"}, "sshPublicKey", "PRIVATE key"),
    ({"sshPublicKey": "ecdsa-sha2-nistp256 AAAAE2VjZHNh"}, "sshPublicKey", "id_ed25519.pub"),
    ({"nodeCount": "0"}, "nodeCount", "between 1 and 64"),
    ({"nodeCount": "65"}, "nodeCount", "between 1 and 64"),
    ({"nodeCount": "four"}, "nodeCount", "pulumi config set nodeCount"),
    ({"spot": "yes"}, "spot", "true or false"),
    ({"instanceType": "t3.micro"}, "instanceType", "core/catalog.py"),
    ({"maxSpotPrice": "cheap"}, "maxSpotPrice", "pulumi config set maxSpotPrice"),
    ({"maxSpotPrice": "-1"}, "maxSpotPrice", "positive"),
    ({"maxSpotPrice": "2.5", "spot": "false"}, "maxSpotPrice", "pulumi config rm maxSpotPrice"),
    ({"capacityRebalance": "true", "spot": "false"}, "capacityRebalance", "pulumi config rm capacityRebalance"),
    ({"capacityRebalance": "maybe"}, "capacityRebalance", "true or false"),
    ({"region": "mars-1"}, "region", "pulumi config set region"),
    ({"availabilityZone": "eu-west-1a"}, "availabilityZone", "us-east-1b"),
    ({"rootVolumeGib": "8"}, "rootVolumeGib", "between 40 and 16384"),
    ({"image": "ubuntu"}, "image", "'bake', 'base' or an AMI id"),
    ({"image": "ami-123"}, "image", "'bake', 'base' or an AMI id"),
    ({"ubuntuVersion": "20.04"}, "ubuntuVersion", "22.04, 24.04"),
    ({"profile": "nope"}, "profile", "pulumi config set profile"),
    ({"profile": "upstream", "ubuntuVersion": "22.04"}, "ubuntuVersion", "pulumi config set ubuntuVersion 24.04"),
    ({"clusterName": "Bert_Cluster"}, "clusterName", "lowercase"),
    ({"vpcCidr": "8.8.0.0/16"}, "vpcCidr", "private IPv4"),
    ({"vpcCidr": "10.0.0.0/8"}, "vpcCidr", "/16 to /24"),
    ({"sshUser": "Root User"}, "sshUser", "pulumi config set sshUser"),
    ({"buildInstanceType": "big"}, "buildInstanceType", "c6i.2xlarge"),
    # each zone letter has an eighth of the VPC: a /24 gives /27s (27 usable addresses), too few for 64 nodes
    ({"vpcCidr": "10.42.0.0/24", "nodeCount": "64"}, "vpcCidr", "needs up to 130"),
    ({"headInstanceType": "t2.nano"}, "headInstanceType", "pulumi config set headInstanceType t3.medium"),
])
def test_each_invalid_value_fails_with_one_line_naming_key_and_fix(config, key, fix):
    with pytest.raises(ClusterError) as err:
        settings(**config)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(key), message
    assert fix in message, message


def test_a_small_vpc_still_fits_a_small_cluster_in_each_zone_slice():
    assert settings(vpcCidr="10.42.0.0/24", nodeCount="12").node_count == 12  # 27 usable >= 2 * 12 + 2
    with pytest.raises(ClusterError, match=r"vpcCidr 10.42.0.0/24 gives each zone a /27 subnet \(27 usable "
                                           r"addresses\) but nodeCount 13 needs up to 28"):
        settings(vpcCidr="10.42.0.0/24", nodeCount="13")


def test_python_rule_does_not_apply_to_an_explicit_ami():
    assert settings(profile="upstream", ubuntuVersion="22.04", image="ami-0123456789abcdef0").profile == "upstream"


def test_world_ssh_is_accepted_only_when_asked_for():
    assert settings(adminCidr="0.0.0.0/0", allowWorldSsh="true").admin_cidr == "0.0.0.0/0"


def test_ubuntu_parameter_follows_the_release():
    assert settings(ubuntuVersion="22.04", profile="oneccl").ubuntu_ami_parameter == \
        "/aws/service/canonical/ubuntu/server/22.04/stable/current/amd64/hvm/ebs-gp2/ami-id"
    assert settings(ubuntuVersion="24.04").ubuntu_ami_parameter == \
        "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id"


def test_pulumi_yaml_declares_every_key_typed_with_the_settings_defaults():
    project = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())
    assert project["runtime"] == {"name": "python", "options": {"virtualenv": ".venv"}}
    declared = project["config"]
    assert set(declared) == set(CONFIG_KEYS)
    kinds = {"int": "integer", "bool": "boolean", "str": "string"}
    for key, field in CONFIG_KEYS.items():
        entry = declared[key]
        assert entry["type"] == kinds[field.type], key
        assert entry["description"].strip(), key
        assert entry["default"] == field.default, f"{key}: Pulumi.yaml default differs from ClusterSettings"


def test_catalog_has_the_required_types_with_consistent_topology():
    required = {"c6i.8xlarge", "c6i.16xlarge", "c6i.32xlarge", "r7iz.8xlarge", "r7iz.16xlarge", "r7iz.32xlarge",
                "r7iz.metal-16xl", "r7iz.metal-32xl"}
    assert required <= set(catalog.CATALOG)
    for t in catalog.CATALOG.values():
        assert t.cores * t.threads_per_core == t.vcpus and t.cores_per_socket * t.sockets == t.cores, t.name
        assert t.amx == ("Sapphire Rapids" in t.cpu), t.name
    assert catalog.lookup("r7iz.metal-32xl").sockets == 2 and catalog.lookup("r7iz.metal-32xl").efa
    with pytest.raises(ClusterError, match="not in the catalog"):
        catalog.lookup("p5.48xlarge")


def test_ops_guide_documents_every_config_key():
    guide = (ROOT / "docs" / "ops.md").read_text()
    missing = [key for key in CONFIG_KEYS if f"| `{key}` |" not in guide]
    assert not missing, f"docs/ops.md lacks config keys {missing}"
