"""One twin instance's metadata service (IMDSv2), run inside the instance's network namespace at AWS's own address.

`python -m cluster.imds FILE` serves 169.254.169.254:80 from FILE, a JSON document that the AWS twin
(twin.up) rewrites to announce a notice: it is read again on every request, so a notice shows on the next poll.
Answers as EC2 does: PUT /latest/api/token (TTL header required), then GET with the token for instance-id,
placement/availability-zone and region, local-ipv4, the instance profile's credentials, spot/instance-action (404
until a spot notice), events/recommendations/rebalance (404 until one), autoscaling/target-lifecycle-state.
"""
from __future__ import annotations

import json
import secrets
import socketserver
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ADDRESS = "169.254.169.254"
META = "/latest/meta-data/"


def answer(doc: dict, path: str) -> str | None:
    """The body for one metadata path, None for 404."""
    key = path[len(META):] if path.startswith(META) else None
    role = doc.get("role", "")
    table = {
        "instance-id": doc.get("instance_id"),
        "local-ipv4": doc.get("local_ipv4"),
        "placement/availability-zone": doc.get("availability_zone"),
        "placement/region": doc.get("region"),
        "autoscaling/target-lifecycle-state": doc.get("lifecycle_state", "InService"),
        "spot/instance-action": json.dumps(doc["notice"]) if doc.get("notice") else None,
        "events/recommendations/rebalance": json.dumps(doc["rebalance"]) if doc.get("rebalance") else None,
        "iam/security-credentials/": role or None,
        f"iam/security-credentials/{role}": json.dumps({
            "Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": doc.get("access_key", "xc-twin"),
            "SecretAccessKey": doc.get("secret_key", "xc-twin"), "Token": "xc-twin-session",
            "LastUpdated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "Expiration": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 6 * 3600))}) if role else None,
    }
    return table.get(key) if key is not None else None


def serve(doc_file: Path, address: str = ADDRESS, port: int = 80) -> ThreadingHTTPServer:
    tokens: set[str] = set()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code: int, body: str = "") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self):
            if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return self._send(400)
            token = secrets.token_urlsafe(24)
            tokens.add(token)
            self._send(200, token)

        def do_GET(self):
            if self.headers.get("X-aws-ec2-metadata-token") not in tokens:
                return self._send(401)
            try:
                doc = json.loads(doc_file.read_text())
            except (OSError, ValueError):
                return self._send(500)
            body = answer(doc, self.path)
            self._send(200, body) if body is not None else self._send(404)

    return _Server((address, port), Handler)


class _Server(ThreadingHTTPServer):
    def server_bind(self):
        # HTTPServer's own looks its address up in DNS (getfqdn), which in a namespace with no DNS waits 10 s
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


if __name__ == "__main__":
    server = serve(Path(sys.argv[1]), *(sys.argv[2:3] or [ADDRESS]), *([int(sys.argv[3])] if len(sys.argv) > 3 else []))
    server.serve_forever()
