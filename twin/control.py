"""The AWS twin's control plane: a moto server with the two Auto Scaling calls it lacks, which our nodes make.

`python -m twin.control HOST PORT JOURNAL PUBLIC`: moto's own server (EC2, Auto Scaling, S3, IAM, STS, SSM over
real HTTP), plus CompleteLifecycleAction and RecordLifecycleActionHeartbeat, which moto 5 answers with a 500. Each of
them is appended to JOURNAL as a JSON line, so the twin can end a held termination when the node lets it go, as the
group does on AWS, instead of only at the end of the hook's heartbeat.

It also refuses what AWS refuses and moto lets through, an instance of an image that does not exist (a deregistered
AMI: refuse_missing_images), and launches from a new launch template version (template_versions_with_user_data). The public addresses it gives instances come from PUBLIC, a /24 of 198.18.0.0/15
that the twin routes to its bridge, never moto's own (real internet addresses): see public_addresses.
"""
from __future__ import annotations

import ipaddress
import itertools
import json
import sys
import time


def journal_calls(journal: str) -> None:
    from moto.autoscaling.responses import AutoScalingResponse
    from moto.core.responses import EmptyResult

    def record(kind: str):
        def call(self) -> EmptyResult:
            entry = {"call": kind, "time": time.time(), "group": self._get_param("AutoScalingGroupName"),
                     "hook": self._get_param("LifecycleHookName"), "instance": self._get_param("InstanceId"),
                     "result": self._get_param("LifecycleActionResult")}
            with open(journal, "a") as f:
                f.write(json.dumps(entry) + "\n")
            return EmptyResult()
        return call

    AutoScalingResponse.complete_lifecycle_action = record("complete")
    AutoScalingResponse.record_lifecycle_action_heartbeat = record("heartbeat")


def refuse_missing_images() -> None:
    """RunInstances of an AMI that does not exist, a deregistered one included, fails with InvalidAMIID.NotFound, as
    on AWS (moto, even with MOTO_ENABLE_AMI_VALIDATION, launches a deregistered AMI). A group's launch that fails so
    does not fail the call that made the group launch (a termination, a new capacity): as on AWS, that call
    succeeds, the group stays short, and DescribeScalingActivities says why."""
    import datetime
    import uuid

    from moto.autoscaling.models import FakeAutoScalingGroup
    from moto.autoscaling.responses import AutoScalingResponse
    from moto.core.responses import ActionResult
    from moto.ec2.exceptions import InvalidAMIIdError
    from moto.ec2.models.instances import InstanceBackend

    run = InstanceBackend.run_instances

    def run_instances(self, image_id, count, user_data, security_group_names, **kwargs):
        template = kwargs.get("launch_template")
        image = image_id or (template and self._get_template_from_args(template).image_id)
        if image and image not in self.amis:
            raise InvalidAMIIdError(image)
        return run(self, image_id, count, user_data, security_group_names, **kwargs)

    failed: list[dict] = []
    launch = FakeAutoScalingGroup.replace_autoscaling_group_instances

    def replace(self, count_needed: int, propagated_tags: dict) -> None:
        try:
            launch(self, count_needed, propagated_tags)
        except InvalidAMIIdError as exc:
            now = datetime.datetime.now(datetime.timezone.utc)
            failed.append({"ActivityId": str(uuid.uuid4()), "AutoScalingGroupName": self.name,
                           "Description": "Launching a new EC2 instance.  Status Reason: " + exc.message,
                           "Cause": f"At {now:%Y-%m-%dT%H:%M:%SZ} an instance was started in response to a difference "
                           "between desired and actual capacity.", "StartTime": now, "EndTime": now,
                           "StatusCode": "Failed", "StatusMessage": f"{exc.message}. Launching EC2 instance failed.",
                           "Progress": 100})

    def activities(self) -> ActionResult:
        group = self._get_param("AutoScalingGroupName")
        return ActionResult({"Activities": [a for a in reversed(failed) if group in (None, a["AutoScalingGroupName"])]})

    InstanceBackend.run_instances = run_instances
    FakeAutoScalingGroup.replace_autoscaling_group_instances = replace
    AutoScalingResponse.describe_scaling_activities = activities


def template_versions_with_user_data() -> None:
    """CreateLaunchTemplateVersion's user data decoded as CreateLaunchTemplate's is: moto 5 keeps a new version's
    as it came, and a group's launch from that version then fails (an assertion, a 500)."""
    from moto.ec2.models.launch_templates import LaunchTemplate
    from moto.ec2.utils import parse_user_data

    create = LaunchTemplate.create_version

    def create_version(self, data: dict, description: str):
        if isinstance(data.get("UserData"), str):
            data = {**data, "UserData": parse_user_data(data["UserData"])}
        return create(self, data, description)

    LaunchTemplate.create_version = create_version


def public_addresses(subnet: str) -> None:
    """moto's public addresses (54.214.x.y) from ``subnet`` instead, in turn: .2 to .254 (.1 is the operator's)."""
    from moto.ec2 import utils
    from moto.ec2.models import elastic_network_interfaces

    hosts = itertools.cycle(str(h) for h in list(ipaddress.IPv4Network(subnet).hosts())[1:])
    utils.random_public_ip = elastic_network_interfaces.random_public_ip = lambda: next(hosts)


if __name__ == "__main__":
    host, port, journal, public = sys.argv[1:5]
    journal_calls(journal)
    public_addresses(public)
    refuse_missing_images()
    template_versions_with_user_data()
    from moto.server import main

    main(["-H", host, "-p", port])
