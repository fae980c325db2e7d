"""The AWS twin's control plane: a moto server with the two Auto Scaling calls it lacks, which our nodes make.

`python -m cluster.twin_moto HOST PORT JOURNAL`: moto's own server (EC2, Auto Scaling, S3, IAM, STS, SSM over real
HTTP), plus CompleteLifecycleAction and RecordLifecycleActionHeartbeat, which moto 5 answers with a 500. Each of
them is appended to JOURNAL as a JSON line, so the twin can end a held termination when the node lets it go, as the
group does on AWS, instead of only at the end of the hook's heartbeat.
"""
from __future__ import annotations

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


if __name__ == "__main__":
    host, port, journal = sys.argv[1:4]
    journal_calls(journal)
    from moto.server import main

    main(["-H", host, "-p", port])
