"""The nodes' and the head's user data pass cloud-init's own schema check: cloud-init runs it
only at first boot on a real instance, where a malformed cloud-config fails silently.

cloud-init is not on PyPI, so the check here is its schema (tests/data/cloud-init: vendored from Debian 12's
cloud-init 22.4.2) applied as `cloud-init schema --config-file F` applies it: the '#cloud-config' header, a YAML
mapping, JSON Schema draft 4 with format checks, and a deprecated key is an error (that command's strict mode).
Where a `cloud-init` command is installed, the last test runs it too. Checked by hand with Debian's 22.4.2 code:
it accepts both rendered files and reports the two errors test_a_malformed_cloud_config_is_rejected expects.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from pulumi_mocks import KEY  # (importing it installs Pulumi's mocks first)

from infra.head import head_user_data
from infra.nodes import user_data
from infra.settings import ClusterSettings

SCHEMA = Path(__file__).resolve().parents[1] / "data" / "cloud-init" / "schema-cloud-config-v1.json"
HEADER = "#cloud-config"
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (pyproject's dev extra) validates cloud-config")


def cloud_init_errors(text: str) -> list[str]:
    """What `cloud-init schema --config-file` reports for ``text``, as 'path: message' lines ([] = valid)."""
    if not text.startswith(HEADER):
        return [f'format-l1.c1: File needs to begin with "{HEADER}"']
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return [f"format: File is not valid yaml. {exc}"]
    if not isinstance(config, dict):
        return ["Cloud-config is not a YAML dict."]

    def deprecated(_validator, is_deprecated, _instance, schema):
        if is_deprecated:
            yield jsonschema.ValidationError(f"DEPRECATED: {schema.get('description', '')}".strip())

    validator_class = jsonschema.validators.extend(jsonschema.Draft4Validator, {"deprecated": deprecated})
    validator = validator_class(json.loads(SCHEMA.read_text()), format_checker=jsonschema.FormatChecker())
    return sorted(f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(config))


def settings(**extra) -> ClusterSettings:
    return ClusterSettings(admin_cidr="203.0.113.7/32", ssh_public_key=KEY, **extra)


RENDERED = {
    "node bake": lambda: user_data(settings()),
    "node base": lambda: user_data(settings(image="base", profile="upstream", cluster_name="bert-8")),
    "head": lambda: head_user_data(settings(), "s3://xc-dev-0123456789/dev"),
    "head cn": lambda: head_user_data(settings(region="cn-north-1"), "s3://xc-dev-0123456789/dev"),
}


@pytest.mark.parametrize("kind", sorted(RENDERED))
def test_the_user_data_passes_cloud_inits_schema(kind):
    text = RENDERED[kind]()
    assert text.startswith(HEADER + "\n")
    assert cloud_init_errors(text) == []
    config = yaml.safe_load(text)
    assert {f["path"] for f in config["write_files"]} >= {"/etc/xeon-cluster/cluster.env",
                                                          "/usr/local/sbin/xc-publish-host-keys"}


def test_a_malformed_cloud_config_is_rejected():
    """The validator finds what cloud-init 22.4.2 finds (checked by hand with its own code): a wrong type, a
    number for a string, a missing header, a deprecated key."""
    good = user_data(settings())
    bad = good.replace('permissions: "0755"', "permissions: 755", 1).replace("runcmd:", "runcmd: 3\nx_runcmd:")
    assert cloud_init_errors(bad) == ["runcmd: 3 is not of type 'array'",
                                      "write_files.1.permissions: 755 is not of type 'string'"]
    assert cloud_init_errors(good.replace(HEADER, "#cloud-confg", 1))[0].startswith("format-l1.c1")
    # 'apt_update' is deprecated in the 22.4 schema (package_update replaces it)
    assert any("DEPRECATED" in e for e in cloud_init_errors(good + "apt_update: true\n"))
    assert cloud_init_errors(good + "  - [: broken\n")[0].startswith("format: File is not valid yaml")


@pytest.mark.skipif(shutil.which("cloud-init") is None,
                    reason="no cloud-init command here (Debian's package 'cloud-init'; not on PyPI): the vendored "
                           "schema above stands in for it")
@pytest.mark.parametrize("kind", sorted(RENDERED))
def test_the_installed_cloud_init_accepts_the_user_data(kind, tmp_path):
    path = tmp_path / "user-data.yaml"
    path.write_text(RENDERED[kind]())
    run = subprocess.run(["cloud-init", "schema", "--config-file", str(path)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0 and "Valid cloud-config" in run.stdout, run.stdout + run.stderr


def test_the_heads_boot_script_says_why_in_one_line_and_ends_0_without_a_venv(tmp_path):
    """The head's xc-head-boot, as its user data writes it, run as its unit runs it (its #! line): on a head without
    the project's venv (image=base, or an AMI of one's own) one line says why and it ends 0, where a #! naming the
    venv's python failed the unit with 203/EXEC; with a venv it goes on in that venv's python. The unit sends its
    lines to the console output too."""
    import os
    import sys

    config = yaml.safe_load(RENDERED["head"]())
    files = {f["path"]: f for f in config["write_files"]}
    script = tmp_path / "xc-head-boot"
    script.write_text(files["/usr/local/sbin/xc-head-boot"]["content"])
    script.chmod(int(files["/usr/local/sbin/xc-head-boot"]["permissions"], 8))
    assert script.read_text().startswith("#!/bin/sh\n")
    missing = tmp_path / "no-venv"
    env = {"PATH": os.defpath, "HOME": str(tmp_path), "XC_HEAD_VENV": str(missing)}
    res = subprocess.run([str(script)], capture_output=True, text=True, timeout=30, check=False, env=env)
    assert (res.returncode, res.stderr) == (0, "")
    assert res.stdout == (f"xc-head-boot: no venv at {missing} (image=base): detached runs are supervised from the "
                          "operator's machine; nothing to take over\n")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    # a venv's python (this one's interpreter, without this venv's packages): the script goes on in it, as Python
    (tmp_path / "venv" / "bin" / "python").symlink_to(Path(sys.executable).resolve())
    (tmp_path / "cluster.env").write_text("XC_CLUSTER=dev\nXC_STORE=file:///nowhere\n")
    env.update(XC_HEAD_VENV=str(tmp_path / "venv"), XC_CLUSTER_ENV=str(tmp_path / "cluster.env"))
    res = subprocess.run([str(script)], capture_output=True, text=True, timeout=60, check=False, env=env)
    assert res.returncode == 0 and res.stdout in (  # main's lines: without boto3, or with it
        "xc-head-boot: no venv with the project's packages here: no supervisor can be taken over\n",
        "xc-head-boot: no S3 store in cluster.env (file:///nowhere): nothing to take over\n"), res.stdout + res.stderr
    unit = files["/etc/systemd/system/xc-head.service"]["content"].splitlines()
    assert "ExecStart=/usr/local/sbin/xc-head-boot" in unit and "StandardOutput=journal+console" in unit
