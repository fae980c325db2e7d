"""`fab doctor` rules on recorded lscpu / uname / version / clock output."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.errors import ClusterError
from doctor import checks as C
from doctor.checks import (
    KERNEL_FIX,
    amx_check,
    clock_skew_check,
    kernel_version,
    parse_cpu_flags,
    versions_identical,
)

DATA = Path(__file__).resolve().parents[1] / "data"

# lscpu on an r7iz (Sapphire Rapids, Xeon Gold 6455B) with Ubuntu 24.04's 6.8 AWS kernel.
SPR_LSCPU_68 = (
    "Flags:                                fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat "
    "pse36 clflush mmx fxsr sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology "
    "nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq monitor ssse3 fma cx16 pdcm pcid sse4_1 sse4_2 "
    "x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch "
    "invpcid_single ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid "
    "avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt "
    "xsavec xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd ida arat avx512vbmi umip pku ospke waitpkg "
    "avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq rdpid cldemote movdiri "
    "movdir64b md_clear serialize amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities"
)
# The same CPU under Ubuntu 22.04's 5.15 AWS kernel: the kernel predates AMX, so /proc/cpuinfo
# (which lscpu reads) has no amx_* flags.
SPR_CPUINFO_515 = "flags\t\t: " + " ".join(
    f for f in SPR_LSCPU_68.split(":", 1)[1].split() if not f.startswith("amx_") and f != "avx512_fp16"
)
# c6i (Ice Lake, Xeon Platinum 8375C): AVX512-VNNI, no AMX, no AVX512-BF16.
ICX_LSCPU = (
    "Flags:                                fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat "
    "pse36 clflush mmx fxsr sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology "
    "nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe "
    "popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch invpcid_single "
    "ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq "
    "rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 "
    "xsaves wbnoinvd ida arat avx512vbmi pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg "
    "tme avx512_vpopcntdq rdpid md_clear flush_l1d arch_capabilities"
)


@pytest.mark.parametrize("release,expected", [
    ("6.8.0-1015-aws", (6, 8, 0)),
    ("5.15.0-1051-aws", (5, 15, 0)),
    ("6.1.0-28-cloud-amd64", (6, 1, 0)),
    ("4.14.355-275.570.amzn2.x86_64", (4, 14, 355)),
    ("6.10", (6, 10, 0)),
])
def test_kernel_version(release, expected):
    assert kernel_version(release) == expected


def test_kernel_version_orders_numerically():
    assert kernel_version("5.16.0-1-generic") > kernel_version("5.9.0-1-generic")


def test_kernel_version_rejects_garbage():
    with pytest.raises(ClusterError, match="uname -r"):
        kernel_version("Linux")


def test_parse_cpu_flags_from_lscpu_cpuinfo_and_bare_lists():
    spr = parse_cpu_flags("Architecture:  x86_64\n" + SPR_LSCPU_68 + "\nVirtualization features: ...")
    assert {"amx_bf16", "amx_tile", "amx_int8", "avx512_bf16"} <= spr and "Flags:" not in spr
    cpuinfo = parse_cpu_flags(SPR_CPUINFO_515)
    assert "avx512_vnni" in cpuinfo and not any(f.startswith("amx") for f in cpuinfo)
    assert parse_cpu_flags("sse avx amx_tile") == {"sse", "avx", "amx_tile"}
    assert parse_cpu_flags("Model name: Intel(R) Xeon(R)") == set()


def test_sapphire_rapids_on_a_new_kernel_has_amx():
    r = amx_check(parse_cpu_flags(SPR_LSCPU_68), "6.8.0-1015-aws", expect_amx=True)
    assert r.ok and "amx_bf16" in r.detail and r.fix == ""


def test_sapphire_rapids_on_5_15_fails_with_the_kernel_fix():
    r = amx_check(parse_cpu_flags(SPR_CPUINFO_515), "5.15.0-1051-aws", expect_amx=True)
    assert not r.ok and r.fix == KERNEL_FIX
    assert "5.15.0-1051-aws" in r.detail and "amx_bf16" in r.detail


def test_amx_flags_on_an_old_kernel_are_still_unusable():
    r = amx_check(parse_cpu_flags(SPR_LSCPU_68), "5.15.0-1051-aws", expect_amx=True)
    assert not r.ok and r.fix == KERNEL_FIX


def test_ice_lake_without_amx_is_fine_when_none_is_expected():
    flags = parse_cpu_flags(ICX_LSCPU)
    assert "avx512_vnni" in flags and "avx512_bf16" not in flags
    r = amx_check(flags, "6.8.0-1015-aws", expect_amx=False)
    assert r.ok and "absent" in r.detail and "prefer fp32" in r.detail


def test_missing_amx_on_a_new_kernel_blames_the_instance_not_the_kernel():
    r = amx_check(parse_cpu_flags(ICX_LSCPU), "6.8.0-1015-aws", expect_amx=True)
    assert not r.ok and r.fix != KERNEL_FIX and "instance type" in r.fix


def test_unparsable_uname_is_a_failed_check_not_a_crash():
    r = amx_check(parse_cpu_flags(SPR_LSCPU_68), "", expect_amx=True)
    assert not r.ok and "uname -r" in r.fix


def test_versions_identical_on_every_node():
    same = {"torch": "2.7.1+cpu", "transformers": "4.56.2"}
    results = versions_identical({"node-0": same, "node-1": dict(same), "node-2": dict(same)})
    assert [r.name for r in results] == ["torch version", "transformers version"]
    assert all(r.ok for r in results) and "on all 3 nodes" in results[0].detail


def test_versions_identical_names_the_odd_node_and_a_missing_package():
    per_node = {
        "node-0": {"torch": "2.7.1+cpu", "six": "1.16.0"},
        "node-1": {"torch": "2.7.1+cpu", "six": "1.16.0"},
        "node-2": {"torch": "2.8.0+cpu"},
    }
    results = {r.name: r for r in versions_identical(per_node)}
    torch, six = results["torch version"], results["six version"]
    assert not torch.ok and "node-2 has 2.8.0+cpu" in torch.detail and "2 node(s) have 2.7.1+cpu" in torch.detail
    assert "node-2" in torch.fix and "node-0" not in torch.fix
    assert not six.ok and "node-2 has missing" in six.detail


def test_clock_skew():
    ok = clock_skew_check({"node-0": 0.0, "node-1": 0.02, "node-2": -0.05})
    assert ok.ok and "0.070 s" in ok.detail
    bad = clock_skew_check({"node-0": 0.0, "node-1": 0.01, "node-2": 0.02, "node-3": 4.5})
    assert not bad.ok and "node-3" in bad.detail and "node-3" in bad.fix and "chrony" in bad.fix
    assert clock_skew_check({"a": 0.0, "b": 0.3}, max_skew_s=0.1).ok is False
    assert clock_skew_check({}).ok is False


@pytest.mark.parametrize("model, expected", [
    ("Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz", False),  # Ice Lake (c6i)
    ("Intel(R) Xeon(R) Gold 6455B", True),  # Sapphire Rapids (r7iz), recorded in tests/data
    ("Intel(R) Xeon(R) Platinum 8488C", True),  # Sapphire Rapids (c7i)
    ("Intel(R) Xeon(R) Platinum 8592+", True),  # Emerald Rapids
    ("Intel(R) Xeon(R) Platinum 8259CL CPU @ 2.50GHz", False),  # Cascade Lake
    ("Intel(R) Xeon(R) 6975P-C", True),  # Granite Rapids (P-cores)
    ("Intel(R) Xeon(R) 6780E", False),  # Sierra Forest (E-cores)
    ("AMD EPYC 9R14", False),
    ("Intel(R) Xeon(R) Processor", None),  # a hypervisor's generic name: unknown
])
def test_model_has_amx(model, expected):
    assert C.model_has_amx(model) is expected


def test_recorded_probes_agree_with_the_model_rule():
    from launch.plan import topology

    for name, expected in [("c6i.16xlarge", False), ("r7iz.metal-16xl", True)]:
        topo = topology.parse((DATA / f"{name}.probe").read_text())
        assert C.model_has_amx(topo.model) is expected
        assert topo.amx is expected  # the recorded flags say the same


def test_doctor_report_names_failures_with_fixes_and_does_not_count_skips():
    from core.errors import NodeFailure
    from core.report import CLUSTER, Report, Row

    healthy = Report(["node0", "node1"], [Row("node0", "CPU", True, "x"), Row(CLUSTER, "clock skew", True, "y"),
                                          Row("node1", "AMX", True, "unknown CPU", skipped=True)])
    assert healthy.ok and healthy.verdict() == "verdict: healthy: 2 checks passed on 2 node(s) (1 skipped)"
    healthy.raise_if_failed()  # nothing to raise
    bad = Report(["node0", "node1"], [
        Row("node0", "CPU", True, "x"),
        Row("node1", "reachable", False, "node1 is unreachable", "start it"),
        Row(CLUSTER, "all-reduce", False, "not run: node1 unreachable", "fix the rows", skipped=True),
    ])
    assert not bad.ok and [r.check for r in bad.failures] == ["reachable"]
    text = bad.render()
    assert text.index("node0:") < text.index("node1:") < text.index("across the nodes:")
    assert re.search(r"^  reachable +FAIL  node1 is unreachable\n +fix: start it$", text, re.MULTILINE), text
    assert "fix: fix the rows" not in text  # a skipped row has nothing of its own to fix
    assert text.splitlines()[-1].startswith("verdict: 1 problem(s): node1 reachable")
    with pytest.raises(NodeFailure) as err:
        bad.raise_if_failed("preflight")
    assert err.value.nodes == ["node1"] and "\n" not in str(err.value)
    assert str(err.value) == "preflight found 1 problem(s): node1 reachable: node1 is unreachable (fix: start it)"


def test_amx_expectation_prefers_the_instance_type_then_the_model_then_the_flags():
    from cluster.node import Node
    from doctor.rows import amx_expectation
    from launch.plan import topology

    icx = topology.parse((DATA / "c6i.16xlarge.probe").read_text())
    spr = topology.parse((DATA / "r7iz.metal-16xl.probe").read_text())
    node = Node("n", "h", "h", "u")
    assert amx_expectation(node, icx)[0] is False and amx_expectation(node, spr)[0] is True
    # A c7i (Sapphire Rapids) whose kernel hides AMX: the instance type says AMX is expected.
    c7i = Node("n", "h", "h", "u", labels={"instance_type": "c7i.16xlarge"})
    expect, why = amx_expectation(c7i, icx)
    assert expect is True and "c7i.16xlarge" in why
    generic = icx.__class__(**{**icx.__dict__, "model": "Intel(R) Xeon(R) Processor"})
    assert amx_expectation(node, generic)[0] is None  # unknown: the doctor skips with a note
    with_flags = generic.__class__(**{**generic.__dict__, "flags": spr.flags})
    assert amx_expectation(node, with_flags) == (True, "the CPU's own amx flags")
