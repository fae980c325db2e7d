"""node_setup/publish_host_keys.py's first-boot behaviour: it keeps trying with backoff
for about ten minutes (a new role's policy takes a while to reach IAM everywhere), and it calls EC2 at the
partition's own DNS suffix (amazonaws.com.cn in China), from IMDS or, where IMDS does not say, the region.
The end-to-end publish against moto is in tests/cluster/test_hostkeys.py."""
from __future__ import annotations

import runpy
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from fake_imds import FakeIMDS

ROOT = Path(__file__).resolve().parents[2]
publisher = runpy.run_path(str(ROOT / "node_setup" / "publish_host_keys.py"), run_name="publisher")


def test_the_pauses_double_up_to_a_minute_and_add_up_to_about_ten_minutes():
    pauses = publisher["waits"]()
    assert pauses[:5] == [5, 10, 20, 40, 60] and set(pauses[4:]) == {60}
    assert 540 <= sum(pauses) <= 600  # plus the tries themselves: about ten minutes in all
    assert publisher["waits"](30) == [5, 10]


def test_a_publisher_that_cannot_reach_imds_retries_with_the_pauses_then_gives_up(monkeypatch, tmp_path, capsys):
    with socket.socket() as s:  # a loopback port nobody listens on: every try fails at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("XC_IMDS_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("XC_SSH_HOST_KEY_DIR", str(tmp_path))
    (tmp_path / "ssh_host_ed25519_key.pub").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample root@x\n")
    slept: list[float] = []
    assert publisher["main"](sleep=slept.append, deadline_s=600) == 1
    assert slept == publisher["waits"](600)
    tries = capsys.readouterr().err.strip().splitlines()
    assert len(tries) == len(slept) + 1 and tries[-1].startswith(f"xc-publish-host-keys: try {len(tries)}/{len(tries)}:")


class DomainIMDS:
    """IMDSv2 answering services/domain, as an instance in a China region does."""

    def __init__(self, domain: str):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_PUT(self):
                self._send(200, b"token")

            def do_GET(self):
                ok = self.path == "/latest/meta-data/services/domain" and self.headers.get(
                    "X-aws-ec2-metadata-token") == "token"
                self._send(200 if ok else 404, domain.encode() if ok else b"")

            def _send(self, code, body):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_the_ec2_endpoint_takes_the_partitions_dns_suffix_from_imds():
    imds = DomainIMDS("amazonaws.com.cn")
    try:
        domain = publisher["dns_suffix"](imds.url, "token", "cn-north-1")
    finally:
        imds.close()
    assert domain == "amazonaws.com.cn"
    assert publisher["ec2_url"]("cn-north-1", domain) == "https://ec2.cn-north-1.amazonaws.com.cn/"


@pytest.mark.parametrize("region, domain", [("cn-northwest-1", "amazonaws.com.cn"), ("eu-west-1", "amazonaws.com"),
                                            ("us-gov-west-1", "amazonaws.com")])
def test_without_services_domain_in_imds_the_region_decides(region, domain):
    imds = FakeIMDS()  # answers 404 for services/domain
    try:
        token = publisher["imds"](imds.url, "", None)
        assert publisher["dns_suffix"](imds.url, token, region) == domain
    finally:
        imds.close()
