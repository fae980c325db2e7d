"""What a node's CPUs look like, and the process/thread layout derived from it."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

# Allocators a node may have, where Debian/Ubuntu and RHEL-likes put them; the preference order below picks one
MALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib64/libtcmalloc.so.4", "/usr/lib64/libjemalloc.so.2")
# One command gathers everything; sections are split on '### name'.
PROBE = r"""
echo '### lscpu'; LC_ALL=C lscpu
echo '### lscpu-p'; LC_ALL=C lscpu -p=CPU,CORE,SOCKET,NODE
echo '### allowed'; grep Cpus_allowed_list /proc/self/status
echo '### meminfo'; grep MemTotal /proc/meminfo
echo '### uname'; uname -r
echo '### malloc'; ls {malloc} 2>/dev/null || true
""".strip().replace("{malloc}", " ".join(MALLOC_PATHS))

MALLOC_PREFERENCE = ("libtcmalloc.so", "libtcmalloc_minimal.so", "libjemalloc.so")


def preferred_malloc(libs) -> str | None:
    """The allocator ranks preload (LD_PRELOAD): the first of MALLOC_PREFERENCE among libs, else None."""
    for pref in MALLOC_PREFERENCE:
        found = next((lib for lib in libs if pref in lib), None)
        if found:
            return found
    return None


def local_malloc() -> str | None:
    """What the probe would pick on this machine (benches run their jobs with the allocator fab gives ranks)."""
    import os

    return preferred_malloc([p for p in MALLOC_PATHS if os.path.isfile(p)])


def split_sections(text: str) -> dict[str, str]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^### (\S+)$", line)
        if m:
            current = m.group(1)
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return {k: "\n".join(v) for k, v in sections.items()}


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]"""
    cpus: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


@dataclass(frozen=True)
class Topology:
    model: str
    sockets: int
    cores_per_socket: int
    threads_per_core: int
    # Physical cores this node may use, grouped by socket; each core is its first logical CPU.
    cores_by_socket: tuple[tuple[int, ...], ...]
    flags: frozenset[str] = field(default_factory=frozenset)
    mem_gib: float = 0.0
    kernel: str = ""
    malloc: str | None = None

    @property
    def physical_cores(self) -> int:
        return sum(len(c) for c in self.cores_by_socket)

    @property
    def amx(self) -> bool:
        return {"amx_bf16", "amx_tile"} <= self.flags

    @property
    def bf16(self) -> bool:
        return self.amx or "avx512_bf16" in self.flags

    def summary(self) -> str:
        isa = "AMX" if self.amx else ("AVX512-BF16" if self.bf16 else
                                      ("AVX512" if "avx512f" in self.flags else "AVX2"))
        return (f"{self.model}: {len(self.cores_by_socket)} socket(s), {self.physical_cores} usable "
                f"physical cores, {isa}, {self.mem_gib:.0f} GiB")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["flags"] = sorted(self.flags)
        d["physical_cores"] = self.physical_cores
        d["amx"] = self.amx
        d["bf16"] = self.bf16
        return d


def parse(probe_output: str) -> Topology:
    """Parse the output of PROBE (lscpu, lscpu -p, allowed CPUs, memory, kernel, malloc)."""
    s = split_sections(probe_output)
    info = {}
    for line in s.get("lscpu", "").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info[key.strip()] = value.strip()
    if "Flags" not in info or "lscpu-p" not in s:
        raise ValueError("lscpu output missing: is util-linux installed on the node?")
    allowed = None
    m = re.search(r"Cpus_allowed_list:\s*(\S+)", s.get("allowed", ""))
    if m:
        allowed = set(parse_cpu_list(m.group(1)))
    by_socket: dict[int, dict[int, int]] = {}
    for line in s["lscpu-p"].splitlines():
        if not line or line.startswith("#"):
            continue
        cpu, core, socket, *_ = (int(x) if x else 0 for x in line.split(","))
        if allowed is not None and cpu not in allowed:
            continue
        cores = by_socket.setdefault(socket, {})
        cores[core] = min(cpu, cores.get(core, cpu))
    mem = re.search(r"MemTotal:\s*(\d+)\s*kB", s.get("meminfo", ""))
    malloc = preferred_malloc(s.get("malloc", "").split())
    return Topology(
        model=info.get("Model name", "unknown"),
        sockets=int(info.get("Socket(s)", 1)),
        cores_per_socket=int(info.get("Core(s) per socket", 1)),
        threads_per_core=int(info.get("Thread(s) per core", 1)),
        cores_by_socket=tuple(tuple(sorted(c.values())) for _, c in sorted(by_socket.items()) if c),
        flags=frozenset(info["Flags"].split()),
        mem_gib=int(mem.group(1)) / 2**20 if mem else 0.0,
        kernel=s.get("uname", "").strip(),
        malloc=malloc,
    )


@dataclass(frozen=True)
class Layout:
    """How ranks are placed on one node, and with what threads and pinning."""

    ppn: int
    omp_threads: int
    ccl_workers: int
    # Logical CPUs of each local rank (compute first, then its CCL workers).
    rank_cpus: tuple[tuple[int, ...], ...]
    ccl_cpus: tuple[int, ...]
    notes: tuple[str, ...] = ()

    def pin_domain(self) -> str:
        """I_MPI_PIN_DOMAIN as an explicit list of hex masks, one per local rank."""
        masks = [hex(sum(1 << c for c in cpus)) for cpus in self.rank_cpus]
        return "[" + ",".join(masks) + "]"


def derive_layout(topo: Topology, ppn: int | None = None, threads: int | None = None,
                  backend: str = "gloo", ccl_workers: int | None = None) -> Layout:
    """Default: one process per socket; each gets its socket's cores, less CCL workers under ccl."""
    notes = []
    sockets = [c for c in topo.cores_by_socket if c]
    all_cores = [c for s in sockets for c in s]
    if ppn is None:
        ppn = len(sockets)
    if ppn < 1:
        raise ValueError(f"--ppn {ppn} must be at least 1")
    if ppn > len(all_cores):
        notes.append(f"ppn {ppn} exceeds {len(all_cores)} physical cores: ranks share cores")
    # Split cores so a rank never straddles sockets when ppn is a multiple of the socket count.
    if ppn % len(sockets) == 0:
        per_socket = ppn // len(sockets)
        shares = [_chunk(s, per_socket) for s in sockets]
        rank_cores = [share for group in shares for share in group]
    else:
        rank_cores = _chunk(all_cores, ppn)
    per_rank = min(len(c) for c in rank_cores)
    if backend != "ccl":
        ccl_workers = 0
    elif ccl_workers is None:
        ccl_workers = 2 if per_rank >= 16 else 1
    if threads is None:
        threads = max(1, per_rank - (ccl_workers if per_rank > ccl_workers else 0))
    elif threads < 1:
        raise ValueError(f"--threads {threads} must be at least 1")
    if threads > per_rank:
        notes.append(f"{threads} threads per rank on {per_rank} cores: oversubscribed")
    ccl_cpus = []
    for cores in rank_cores:
        spare = [c for c in cores[threads:]][:ccl_workers] if ccl_workers else []
        ccl_cpus.extend(spare or cores[-ccl_workers:] if ccl_workers else [])
    return Layout(ppn=ppn, omp_threads=threads, ccl_workers=ccl_workers,
                  rank_cpus=tuple(tuple(c) for c in rank_cores), ccl_cpus=tuple(ccl_cpus),
                  notes=tuple(notes))


def derive_layouts(topos: list[Topology], ppn: int, threads: int | None, backend: str) -> list[Layout]:
    """One layout per node with the same thread and CCL worker counts everywhere (mpirun's -genv and
    CCL_WORKER_COUNT are global): the smallest node decides both."""
    layouts = [derive_layout(t, ppn=ppn, threads=threads, backend=backend) for t in topos]
    workers = min(lay.ccl_workers for lay in layouts)
    omp = threads if threads is not None else min(lay.omp_threads for lay in layouts)
    if any(lay.omp_threads != omp or lay.ccl_workers != workers for lay in layouts):
        layouts = [derive_layout(t, ppn=ppn, threads=omp, backend=backend, ccl_workers=workers) for t in topos]
    return layouts


def _chunk(items, n: int) -> list[list[int]]:
    """Split ``items`` into ``n`` contiguous, near-equal, non-empty chunks (reusing when short)."""
    items = list(items)
    if n <= len(items):
        size, extra = divmod(len(items), n)
        out, start = [], 0
        for i in range(n):
            end = start + size + (1 if i < extra else 0)
            out.append(items[start:end])
            start = end
        return out
    return [[items[i % len(items)]] for i in range(n)]
