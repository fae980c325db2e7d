"""Pure rules behind `fab doctor`: each takes recorded facts (lscpu flags, `uname -r`, installed
versions, clock offsets) and returns a CheckResult, so every rule is testable without a node."""
from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass

from core.errors import ClusterError

log = logging.getLogger(__name__)

AMX_FLAGS = frozenset({"amx_bf16", "amx_tile", "amx_int8"})
# Linux 5.16 added the AMX state permission (arch_prctl ARCH_REQ_XCOMP_PERM); older kernels
# neither show the amx_* flags nor let a process use the tile registers.
AMX_MIN_KERNEL = (5, 16)
KERNEL_FIX = "use a kernel >= 5.16, e.g. Ubuntu 22.04 HWE or 24.04"
MAX_CLOCK_SKEW_S = 1.0


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def kernel_version(release: str) -> tuple[int, int, int]:
    """'6.8.0-1015-aws' -> (6, 8, 0); '6.10' -> (6, 10, 0)."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", release)
    if not m:
        raise ClusterError(f"kernel release {release!r} is not MAJOR.MINOR[.PATCH]...", fix="pass the output of 'uname -r'")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def parse_cpu_flags(text: str) -> set[str]:
    """Flags from an lscpu 'Flags:' line, a /proc/cpuinfo 'flags :' line, or a bare list."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == "flags":
            return set(value.split())
    return set(text.split()) if ":" not in text else set()


def amx_check(cpu_flags: set[str], kernel_release: str, expect_amx: bool) -> CheckResult:
    """AMX is usable when the CPU shows amx_bf16/amx_tile/amx_int8 and the kernel is >= 5.16."""
    name = "AMX"
    try:
        kernel = kernel_version(kernel_release)
    except ClusterError as exc:
        return CheckResult(name, False, str(exc), "record 'uname -r' from the node")
    kernel_ok = kernel[:2] >= AMX_MIN_KERNEL
    missing = sorted(AMX_FLAGS - cpu_flags)
    bf16 = "AVX512-BF16" if "avx512_bf16" in cpu_flags else "no bf16 instructions (bf16 is emulated: prefer fp32)"
    if not expect_amx:
        have = "present" if not missing else "absent"
        detail = f"not expected for this instance type; AMX {have}, {bf16}, kernel {kernel_release}"
        return CheckResult(name, True, detail)
    if not missing and kernel_ok:
        return CheckResult(name, True, f"{' '.join(sorted(AMX_FLAGS))} on kernel {kernel_release}")
    if not kernel_ok:
        shown = f"flags {' '.join(missing)} missing" if missing else "amx flags present"
        return CheckResult(name, False, f"the instance type has AMX but kernel {kernel_release} is older than 5.16 "
                           f"({shown}); bf16 runs without AMX", KERNEL_FIX)
    return CheckResult(name, False, f"the instance type should have AMX but flags {' '.join(missing)} are missing on "
                       f"kernel {kernel_release} (>= 5.16)",
                       "check the instance type (AMX needs Sapphire Rapids or newer: m7i, c7i, r7i, r7iz) "
                       "and that the hypervisor exposes AMX")


def versions_identical(per_node: dict[str, dict[str, str]]) -> list[CheckResult]:
    """One result per package: the same version on every node, or which nodes differ from the majority."""
    packages = sorted({pkg for versions in per_node.values() for pkg in versions})
    results = []
    for pkg in packages:
        seen = {node: versions.get(pkg, "missing") for node, versions in per_node.items()}
        counts = Counter(seen.values())
        if len(counts) == 1:
            results.append(CheckResult(f"{pkg} version", True, f"{pkg} {next(iter(counts))} on all {len(seen)} nodes"))
            continue
        # Majority wins; a tie goes to the version node order sees first, so the output is stable.
        top = max(counts.values())
        majority = next(v for v in seen.values() if counts[v] == top)
        odd = sorted(node for node, v in seen.items() if v != majority)
        detail = (f"{pkg} differs: {', '.join(f'{n} has {seen[n]}' for n in odd)}; "
                  f"{counts[majority]} node(s) have {majority}")
        results.append(CheckResult(f"{pkg} version", False, detail,
                                   f"run 'fab setup' so {', '.join(odd)} reinstall the profile"))
    return results


def clock_skew_check(offsets_s: dict[str, float], max_skew_s: float = MAX_CLOCK_SKEW_S) -> CheckResult:
    """Offsets of each node's clock against one reference (seconds); skew = max - min."""
    name = "clock skew"
    if not offsets_s:
        return CheckResult(name, False, "no clock offsets were recorded", "check that every node answers over SSH")
    skew = max(offsets_s.values()) - min(offsets_s.values())
    detail = f"clock skew {skew:.3f} s across {len(offsets_s)} node(s) (limit {max_skew_s:g} s)"
    if skew <= max_skew_s:
        return CheckResult(name, True, detail)
    ordered = sorted(offsets_s.values())
    median = ordered[len(ordered) // 2]
    worst = max(offsets_s, key=lambda node: abs(offsets_s[node] - median))
    return CheckResult(name, False, f"{detail}; {worst} is {offsets_s[worst] - median:+.3f} s off the median",
                       f"enable time sync (chrony with the Amazon Time Sync Service, 169.254.169.123) on {worst}")


# Xeon Scalable names carry the generation in the second digit: Platinum 8375C is 3rd gen (Ice Lake),
# Gold 6455B / Platinum 8488C 4th (Sapphire Rapids, the first with AMX), 85xx 5th (Emerald Rapids).
_XEON_SCALABLE = re.compile(r"Xeon(?:\(R\))?\s+(?:Platinum|Gold|Silver|Bronze)\s+\d(\d)\d\d")
# Xeon 6: P-core parts (Granite Rapids, e.g. 6975P-C) have AMX, E-core parts (Sierra Forest) do not.
_XEON_6 = re.compile(r"Xeon(?:\(R\))?\s+6\d{3}([PE])")


def model_has_amx(model: str) -> bool | None:
    """Whether a CPU of this lscpu 'Model name' has AMX; None when the name does not tell."""
    m = _XEON_SCALABLE.search(model)
    if m:
        return int(m.group(1)) >= 4
    m = _XEON_6.search(model)
    if m:
        return m.group(1) == "P"
    if re.search(r"\bAMD\b|EPYC|Graviton|Neoverse", model):
        return False
    return None
