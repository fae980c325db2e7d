"""A fake EC2 instance metadata service (IMDSv2) on 127.0.0.1 for spot-notice tests: a token from
PUT /latest/api/token (TTL header required), then GET .../spot/instance-action with that token
answers 404 until the test calls interrupt(), then the notice AWS sends two minutes ahead. terminate_by_group()
makes .../autoscaling/target-lifecycle-state answer "Terminated" (a termination lifecycle hook holding the node,
no spot notice), recommend_rebalance() serves .../events/recommendations/rebalance; instance-id, placement/region and the instance
profile's credentials (iam/security-credentials/) answer always."""
from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeIMDS:
    def __init__(self):
        self.token = secrets.token_hex(16)
        self.notice: dict | None = None
        self.lifecycle_state = "InService"
        self.rebalance: dict | None = None
        self.instance_id = "i-0fake0000000000001"
        self.region = "us-east-1"
        self.role = "xc-node"
        self.credentials = {"Code": "Success", "AccessKeyId": "testing", "SecretAccessKey": "testing",
                            "Token": "testing-session", "Expiration": "2099-01-01T00:00:00Z"}
        self.requests: list[tuple[str, str, int]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes = b"") -> None:
                outer.requests.append((self.command, self.path, code))
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._send(400)
                self._send(200, outer.token.encode())

            def do_GET(self):
                if self.headers.get("X-aws-ec2-metadata-token") != outer.token:
                    return self._send(401)
                if self.path == "/latest/meta-data/autoscaling/target-lifecycle-state":
                    return self._send(200, outer.lifecycle_state.encode())
                if self.path == "/latest/meta-data/instance-id":
                    return self._send(200, outer.instance_id.encode())
                if self.path == "/latest/meta-data/placement/region":
                    return self._send(200, outer.region.encode())
                if self.path == "/latest/meta-data/iam/security-credentials/":
                    return self._send(200, outer.role.encode())
                if self.path == f"/latest/meta-data/iam/security-credentials/{outer.role}":
                    return self._send(200, json.dumps(outer.credentials).encode())
                if self.path == "/latest/meta-data/events/recommendations/rebalance" and outer.rebalance:
                    return self._send(200, json.dumps(outer.rebalance).encode())
                if self.path != "/latest/meta-data/spot/instance-action" or outer.notice is None:
                    return self._send(404)
                self._send(200, json.dumps(outer.notice).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    # A run for notice tests: 60 steps on 2 nodes of conftest's thin cut of MiniLM (small_model), paced to ~12
    # steps a second (conftest.PACE). With 0.5 s polls a notice raised at step ~10 ends it within a few steps,
    # leaving a resume of ~45: room for a checkpoint every 20 steps and a node lost after the first (test_restarts),
    # not more (each step of each rank is CPU the whole suite waits for).
    SHORT_ARGS = ("--num_train_epochs", "2", "--per_device_train_batch_size", "8", "--learning_rate", "1e-4",
                  "--max_train_samples", "480", "--max_eval_samples", "64", "--seed", "42")
    SHORT_STEPS = 60  # 480 samples x 2 epochs / (8 per device x 2 nodes)

    @staticmethod
    def short_args(model: str) -> tuple[str, ...]:
        """SHORT_ARGS training `model` (the small_model fixture's folder)."""
        return (*FakeIMDS.SHORT_ARGS, "--model_name_or_path", model)

    def train_env(self) -> list[str]:
        """fab train's --env flags: the ranks poll this server every 0.5 s (not AWS's 5 s), so a short run
        sees a notice within a step or two of the test raising it; and its steps are paced (conftest.PACE)."""
        from conftest import PACE

        return ["--env", f"XC_IMDS_ENDPOINT={self.url}", "--env", "XC_NOTICE_POLL_S=0.5", *PACE]

    def train_until(self, cluster, args, at_step: int = 8, trigger=None, fab_args=(), timeout: float = 600):
        """`fab train --nodes 2 --save-every 0` on `cluster` with this server's env; once a progress line reaches
        `at_step`, `trigger(self)` (default: a spot notice). Returns the ended fab and the seconds from the
        trigger to its end."""
        from conftest import progress_step

        with cluster.start("train", "--nodes", "2", "--save-every", "0", *fab_args, *self.train_env(), "--",
                           *args) as running:
            running.wait_for(lambda line: (progress_step(line) or 0) >= at_step, 400)
            (trigger or FakeIMDS.interrupt)(self)
            triggered = time.monotonic()
            ended = running.finish(timeout)
        return ended, time.monotonic() - triggered

    def interrupt(self) -> None:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
        self.notice = {"action": "terminate", "time": when}

    def terminate_by_group(self) -> None:
        self.lifecycle_state = "Terminated"

    def recommend_rebalance(self) -> None:
        self.rebalance = {"noticeTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def clear(self) -> None:
        """The notice withdrawn: as a replacement instance, which has none, answers."""
        self.notice, self.lifecycle_state, self.rebalance = None, "InService", None

    def close(self) -> None:
        self.server.shutdown()
