"""The Pulumi program under Pulumi's unit-test mocks, shared by the infra tests: a Recorder (every resource and
invoke, answered as AWS would), a monitor that also keeps each resource's options (retainOnDelete,
deleteBeforeReplace, replaceOnChanges, dependencies: options never reach Mocks), and make_program(), which runs
__main__.py's main() with a stack config. Import this module before infra (it installs the mocks first).
"""
from __future__ import annotations

import runpy
from dataclasses import dataclass, field
from pathlib import Path

import pulumi

BAKED_AMI = "ami-0baked00000000000"
BASE_AMI = "ami-0ubuntu0000000000"
ACCOUNT = "123456789012"
ROOT = Path(__file__).resolve().parent.parent
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOp9fX1kZXZlbG9wZXIta2V5LWZvci10ZXN0cw operator@laptop"
REQUIRED = {"adminCidr": "203.0.113.7/32", "sshPublicKey": KEY}
DNS_SUFFIX = {"aws": "amazonaws.com", "aws-cn": "amazonaws.com.cn", "aws-us-gov": "amazonaws.com"}


@dataclass
class Res:
    type: str
    name: str
    inputs: dict
    id: str
    provider: str | None


@dataclass
class Options:
    retain_on_delete: bool
    delete_before_replace: bool
    replace_on_changes: list[str]
    dependencies: list[str]  # URNs, depends_on and input dependencies alike
    import_id: str = ""  # the id of an existing cloud resource Pulumi adopts (ResourceOptions.import_)


class Recorder(pulumi.runtime.Mocks):
    """Records every resource and invoke; answers with the computed outputs AWS would return."""

    def __init__(self, offered_zones=("us-east-1a", "us-east-1b", "us-east-1c"), partition="aws", zones_of=None):
        self.resources: list[Res] = []
        self.calls: list[tuple[str, dict, str]] = []
        self.offered_zones, self.partition = offered_zones, partition
        self.zones_of = zones_of or {}  # instance type -> the zones offering it, where not offered_zones

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        outputs = dict(args.inputs)
        if args.typ == "aws:imagebuilder/image:Image":
            outputs["outputResources"] = [{"amis": [{"image": BAKED_AMI, "region": "us-east-1"}]}]
        elif args.typ == "aws:ec2/launchTemplate:LaunchTemplate":
            outputs["latestVersion"] = 3
        elif args.typ == "aws:ec2/keyPair:KeyPair":
            outputs["keyName"] = args.name
        elif args.typ == "aws:s3/bucket:Bucket":  # a real S3 ARN: the policies built from it get linted
            outputs["arn"] = f"arn:{self.partition}:s3:::{args.name}-id"
        outputs.setdefault("name", args.name)
        outputs.setdefault("arn", f"arn:{self.partition}:mock:::{args.name}")
        self.resources.append(Res(args.typ, args.name, args.inputs, f"{args.name}-id", args.provider))
        return f"{args.name}-id", outputs

    def call(self, args: pulumi.runtime.MockCallArgs):
        self.calls.append((args.token, args.args, args.provider))
        if args.token == "aws:ssm/getParameter:getParameter":
            return {"name": args.args["name"], "value": BASE_AMI, "type": "String", "id": args.args["name"]}
        if args.token == "aws:ec2/getAmi:getAmi":
            return {"id": "ami", "rootDeviceName": "/dev/sda1"}
        if args.token == "aws:ec2/getInstanceTypeOfferings:getInstanceTypeOfferings":
            (types,) = [f["values"] for f in args.args["filters"] if f["name"] == "instance-type"]
            pairs = [(t, z) for t in types for z in self.zones_of.get(t, self.offered_zones)]
            return {"id": "offerings", "instanceTypes": [t for t, _ in pairs], "locations": [z for _, z in pairs],
                    "locationTypes": ["availability-zone"] * len(pairs)}
        if args.token == "aws:index/getPartition:getPartition":
            return {"id": self.partition, "partition": self.partition, "dnsSuffix": DNS_SUFFIX[self.partition]}
        if args.token == "aws:index/getCallerIdentity:getCallerIdentity":
            return {"id": ACCOUNT, "accountId": ACCOUNT, "arn": f"arn:{self.partition}:iam::{ACCOUNT}:user/operator",
                    "userId": "AIDAOPERATOR"}
        if args.token == "aws:index/getServicePrincipal:getServicePrincipal":
            name = f"{args.args['serviceName']}.{DNS_SUFFIX[self.partition]}"
            return {"id": name, "name": name, "region": args.args.get("region"), "suffix": DNS_SUFFIX[self.partition]}
        return {}

    def of(self, typ: str) -> list[Res]:
        return [r for r in self.resources if r.type == typ]

    def named(self, typ: str, name: str) -> Res:
        (found,) = [r for r in self.of(typ) if r.name == name]
        return found

    def one(self, typ: str) -> Res:
        found = self.of(typ)
        assert len(found) == 1, f"{len(found)} x {typ}"
        return found[0]


pulumi.runtime.set_mocks(Recorder(), project="xeon-cluster", stack="dev", preview=False)


class OptionRecorder(pulumi.runtime.mocks.MockMonitor):
    """The mock monitor, also keeping each resource's options (options never reach Mocks), by (type, name)."""

    def __init__(self, mocks: Recorder):
        super().__init__(mocks)
        self.by_key: dict[tuple[str, str], Options] = {}
        self.urns: dict[tuple[str, str], str] = {}

    def RegisterResource(self, request):  # the monitor's gRPC method
        deps = list(request.dependencies) + [u for d in request.propertyDependencies.values() for u in d.urns]
        key = (request.type, request.name)
        self.by_key[key] = Options(request.retainOnDelete, request.deleteBeforeReplace,
                                   list(request.replaceOnChanges), deps, request.importId)
        reply = super().RegisterResource(request)
        self.urns[key] = reply.urn
        return reply

    def key(self, ref: str | tuple[str, str]) -> tuple[str, str]:
        """A resource by (type, name), or by name alone where only one resource has it."""
        if isinstance(ref, tuple):
            return ref
        (found,) = [k for k in self.by_key if k[1] == ref]
        return found

    def options(self, ref: str | tuple[str, str]) -> Options:
        return self.by_key[self.key(ref)]

    @property
    def retained(self) -> dict[str, bool]:
        return {name: o.retain_on_delete for (_, name), o in self.by_key.items()}


@dataclass
class Run:
    mocks: Recorder
    monitor: OptionRecorder
    outputs: dict = field(default_factory=dict)

    def urns(self) -> list[str]:
        return list(self.monitor.get_registered_resources())

    def depends_on(self, ref: str | tuple[str, str], other: str | tuple[str, str]) -> bool:
        """Whether resource ``ref`` waits for resource ``other`` (depends_on or an input of it); each by name
        alone where it is unique, else by (type, name)."""
        return self.monitor.urns[self.monitor.key(other)] in self.monitor.options(ref).dependencies


def make_program():
    """run(mocks=None, **config) -> Run: __main__.py's main() with REQUIRED plus ``config`` as stack config."""

    def run(mocks: Recorder | None = None, required: dict | None = None, **config) -> Run:
        """``required`` replaces REQUIRED (an empty dict: only ``config``, as a fresh stack has)."""
        mocks = mocks or Recorder()
        monitor = OptionRecorder(mocks)
        pulumi.runtime.set_mocks(mocks, project="xeon-cluster", stack="dev", preview=False, monitor=monitor)
        base = REQUIRED if required is None else required
        pulumi.runtime.set_all_config({f"xeon-cluster:{k}": str(v) for k, v in {**base, **config}.items()})
        result = Run(mocks, monitor)

        @pulumi.runtime.test
        def main():
            exported = runpy.run_path(str(ROOT / "__main__.py"), run_name="xeon_cluster_program")["main"]()
            return pulumi.Output.all(**exported).apply(result.outputs.update)

        main()
        return result

    return run
