"""The AMI every node boots, in one of three modes:

- ``bake``: EC2 Image Builder runs the node setup script (the one ``fab setup`` runs) on Ubuntu
  and snapshots the result, so nodes boot ready to train;
- ``base``: stock Ubuntu from Canonical's public SSM parameter, set up later by ``fab setup``;
- ``ami-...``: an AMI the operator already has.
"""
from __future__ import annotations

import hashlib
import json

import pulumi
import pulumi_aws as aws

from core.constants import TAG_PREFIX
from core.errors import ClusterError
from core.render import render
from infra.amis import AmiCleanup
from infra.policies import ROLE_PATH, ec2_trust_policy
from infra.settings import MIN_ROOT_GIB, ClusterSettings
from node_setup import profiles

SCRIPT_PATH = "/opt/xeon-cluster/setup.sh"
MAX_COMPONENT_CHARS = 16000  # Image Builder's limit for an inline component document
BUILD_POLICIES = ("AmazonSSMManagedInstanceCore", "EC2InstanceProfileForImageBuilder")
UBUNTU_ROOT_DEVICE = "/dev/sda1"
BUILD_LOG_DAYS = 30  # Image Builder's own log group never expires; ours does


def component_document(profile: str) -> str:
    """The Image Builder component that installs ``profile``, embedding its setup script verbatim."""
    spec = profiles.load_profile(profile)
    script = profiles.render_setup_script(spec)
    if "{{" in script:  # AWSTOE would read it as a chaining expression and change the script
        raise ClusterError(f"the setup script of profile {profile!r} contains '{{{{', which Image Builder expands", fix=
                           "remove it from templates/node_setup.sh.j2")
    document = render("imagebuilder-component.yaml.j2", profile=profile, script_json=json.dumps(script),
                      script_path=SCRIPT_PATH, venv=profiles.venv_shell_word(spec.venv), marker=profiles.MARKER_NAME,
                      hash=spec.hash, has_torch=spec.version_of("torch") is not None)
    if len(document) > MAX_COMPONENT_CHARS:
        raise ClusterError(f"the setup script of profile {profile!r} makes a {len(document)}-character Image Builder "
                           f"component, over its {MAX_COMPONENT_CHARS} limit", fix="shorten the script or use image=base")
    return document


class Image(pulumi.ComponentResource):
    ami_id: pulumi.Output[str]

    def __init__(self, name: str, settings: ClusterSettings, network, partition: str = "aws",
                 opts: pulumi.ResourceOptions | None = None, ec2_principal: str = "ec2.amazonaws.com",
                 boundary: pulumi.Input[str] | None = None):
        super().__init__("xeon-cluster:infra:Image", name, None, opts)
        self.partition, self.ec2_principal, self.boundary = partition, ec2_principal, boundary
        if settings.image == "bake":
            self.ami_id = self._bake(name, settings, network)
            AmiCleanup(f"{name}-ami", self.ami_id, settings.region, opts=pulumi.ResourceOptions(parent=self))
        elif settings.image == "base":
            self.ami_id = aws.ssm.get_parameter_output(
                name=settings.ubuntu_ami_parameter, opts=pulumi.InvokeOutputOptions(parent=self)).value
        else:
            self.ami_id = pulumi.Output.from_input(settings.image)
        self.register_outputs({"ami_id": self.ami_id})

    def _bake(self, name: str, settings: ClusterSettings, network) -> pulumi.Output[str]:
        child = pulumi.ResourceOptions(parent=self)
        tags = settings.tags
        document = component_document(settings.profile)
        parent_image = f"ssm:{settings.ubuntu_ami_parameter}"  # resolved by Image Builder at build time
        # Component and recipe versions are immutable in Image Builder: a content hash in their names
        # lets Pulumi create the new one before it deletes the old one when the setup script changes.
        digest = hashlib.sha256(f"{document}\n{parent_image}".encode()).hexdigest()[:10]
        component = aws.imagebuilder.Component(
            f"{name}-setup", name=f"{settings.cluster_name}-{settings.profile}-{digest}", version="1.0.0",
            platform="Linux", data=document, description=f"xeon-cluster setup, profile {settings.profile}",
            tags=tags, opts=child)
        recipe_name = f"{settings.cluster_name}-{digest}"
        recipe = aws.imagebuilder.ImageRecipe(
            f"{name}-recipe", name=recipe_name, version="1.0.0", parent_image=parent_image,
            components=[{"component_arn": component.arn}],
            block_device_mappings=[{"device_name": UBUNTU_ROOT_DEVICE, "ebs": {
                "volume_size": MIN_ROOT_GIB, "volume_type": "gp3", "encrypted": "true",
                "delete_on_termination": "true"}}],
            ami_tags={**tags, "Name": f"{settings.cluster_name}-{settings.profile}"}, tags=tags, opts=child)

        # The build instance may use SSM (how Image Builder drives it) and Image Builder's own
        # artefacts; nothing else. The boundary caps the managed policies' ssm:GetParameter on '*' to AWS's
        # public parameters, and the cluster's secrets are encrypted with a key only the head may use.
        role = aws.iam.Role(f"{name}-build", path=ROLE_PATH, tags=tags, opts=child,
                            assume_role_policy=ec2_trust_policy(self.ec2_principal),
                            permissions_boundary=self.boundary)
        attachments = [aws.iam.RolePolicyAttachment(f"{name}-build-{policy}", role=role.name, opts=child,
                                                    policy_arn=f"arn:{self.partition}:iam::aws:policy/{policy}")
                       for policy in BUILD_POLICIES]
        instance_profile = aws.iam.InstanceProfile(f"{name}-build", path=ROLE_PATH,
                                                   role=role.name, tags=tags, opts=child)
        infrastructure = aws.imagebuilder.InfrastructureConfiguration(
            f"{name}-build", instance_profile_name=instance_profile.name,
            instance_types=[settings.build_instance_type], subnet_id=network.subnet.id,
            # its own group, egress only: it runs pip and git downloads, and is no member of the nodes' group
            security_group_ids=[network.build_security_group.id], terminate_instance_on_failure=True,
            instance_metadata_options={"http_tokens": "required", "http_put_response_hop_limit": 1},
            # not the cluster tag: discovery must never take the build instance for a node
            resource_tags={f"{TAG_PREFIX}image-build": settings.cluster_name}, tags=tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=attachments))  # no build before the policies
        # Image Builder logs a build to /aws/imagebuilder/<recipe name>; made first, it is the stack's
        # own (deleted with it) and expires.
        logs = aws.cloudwatch.LogGroup(f"{name}-build-logs", name=f"/aws/imagebuilder/{recipe_name}",
                                       retention_in_days=BUILD_LOG_DAYS, tags=tags, opts=child)
        image = aws.imagebuilder.Image(
            f"{name}-image", image_recipe_arn=recipe.arn, infrastructure_configuration_arn=infrastructure.arn,
            image_tests_configuration={"image_tests_enabled": True, "timeout_minutes": 60}, tags=tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[logs],
                                        custom_timeouts=pulumi.CustomTimeouts(create="120m")))
        return image.output_resources.apply(lambda resources: resources[0].amis[0].image)
