"""oneCCL for bench/backends.py without the discontinued torch bindings: bench/ccl_shim/ccl_shim.cpp (the
project's own C ABI over oneCCL's C++ API) built against the `oneccl-devel` wheel's CPU-only static library and
loaded with ctypes; the KVS address goes from rank 0 to the others over the gloo group the bench already has.

What it needs, none of it a dependency of the project (the bench measures gloo alone without it):
  the wheels          .venv/bin/pip install --no-deps oneccl==2022.2.0 oneccl-devel==2022.2.0
                      (--no-deps: the runtime wheel requires intel-sycl-rt, which the CPU-only library never
                      loads; libfabric comes with impi-rt, already in the venv)
  hwloc and g++       apt-get install libhwloc-dev g++
Transport: oneCCL's ofi ATL with libfabric's tcp provider on the rank's interface (the twin's veth or lo); no
shared memory between the ranks, so the traffic takes the same path as gloo's.
"""
from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "bench" / "ccl_shim" / "ccl_shim.cpp"
BUILD = ROOT / "bench" / "results" / "ccl_shim"  # git-ignored
PREFIX = Path(sys.prefix)  # the venv the wheels went into
STATIC = PREFIX / "lib" / "ccl" / "cpu" / "lib" / "libccl.a"  # oneccl-devel: CPU-only, no SYCL
FAST_MEM = PREFIX / "lib" / "libccl.so.2"  # oneccl: its _intel_fast_memcpy/memset, which libccl.a calls
HOW = ("get oneCCL with `.venv/bin/pip install --no-deps oneccl==2022.2.0 oneccl-devel==2022.2.0` "
       "(and `apt-get install libhwloc-dev g++` if missing)")
LABEL = "ccl = oneCCL 2022.2 through a DDP comm hook (own ctypes shim), not the discontinued bindings"
HOOKS = ("async", "sync")
DTYPES = {"float32": 0, "bfloat16": 1}


def build() -> tuple[Path | None, str]:
    """(the shim's .so, "") or (None, why not); cached by the source's and the library's digest."""
    needed = [PREFIX / "include" / "oneapi" / "ccl.hpp", STATIC, FAST_MEM, PREFIX / "lib" / "libfabric.so.1",
              PREFIX / "lib" / "libtcp-fi.so"]
    missing = [str(p.relative_to(PREFIX)) for p in needed if not p.exists()]
    if missing:
        return None, f"oneCCL's files are not in {PREFIX} ({', '.join(missing)} missing)"
    if not shutil.which("g++"):
        return None, "no g++ to build bench/ccl_shim"
    key = hashlib.sha256(SOURCE.read_bytes() + str(STATIC.stat().st_mtime_ns).encode()).hexdigest()[:12]
    lib = BUILD / f"libxc_ccl-{key}.so"
    if lib.exists():
        return lib, ""
    BUILD.mkdir(parents=True, exist_ok=True)
    cmd = ["g++", "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{PREFIX / 'include'}", str(SOURCE), "-o",
           f"{lib}.tmp", "-Wl,--whole-archive", str(STATIC), "-Wl,--no-whole-archive", str(FAST_MEM), "-lhwloc",
           "-ldl", "-lpthread", "-lrt", f"-Wl,-rpath,{PREFIX / 'lib'}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if res.returncode != 0:
        return None, "building bench/ccl_shim failed: " + ((res.stderr.strip().splitlines() or ["?"])[-1])
    Path(f"{lib}.tmp").rename(lib)
    return lib, ""


def child_env(iface: str, core: int) -> dict[str, str]:
    """What a ccl rank adds to its environment (the gloo ranks get none of it)."""
    return {
        "CCL_ATL_TRANSPORT": "ofi", "FI_PROVIDER": "tcp", "FI_PROVIDER_PATH": str(PREFIX / "lib"),
        "FI_TCP_IFACE": iface, "CCL_KVS_IFACE": iface,
        # launched by the bench, not by mpirun/hydra: each rank is the only one on its (twin) node, and the
        # progress thread stays on the rank's one core, as gloo's threads do
        "CCL_PROCESS_LAUNCHER": "none", "CCL_LOCAL_RANK": "0", "CCL_LOCAL_SIZE": "1", "CCL_WORKER_COUNT": "1",
        "CCL_WORKER_AFFINITY": str(core), "CCL_LOG_LEVEL": "warn",
        # the rank's thread waits for its all-reduce on the same core as the worker that does it: oneCCL's
        # default wait (spinning with `pause`) took the core from the worker (3-6 Gbit/s on loopback against
        # 17-21 with sched_yield or sleep, bert-base fp32, this 2-core EPYC)
        "CCL_YIELD": "sched_yield"}


class Ccl:
    """One communicator over all the gloo group's ranks."""

    def __init__(self, lib_path: str):
        import torch
        import torch.distributed as dist

        self.lib = ctypes.CDLL(lib_path)
        self.pool: ThreadPoolExecutor | None = None  # the async hook's one worker thread, made on first use
        self.lib.xc_ccl_error.restype = ctypes.c_char_p
        self.lib.xc_ccl_allreduce_sum.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.check(self.lib.xc_ccl_init(), "init")
        n = self.lib.xc_ccl_address_size()
        addr = ctypes.create_string_buffer(n)
        if self.rank == 0:
            self.check(self.lib.xc_ccl_main_kvs(addr), "main KVS")
        t = torch.frombuffer(bytearray(addr.raw), dtype=torch.uint8).clone()
        dist.broadcast(t, 0)  # over gloo
        if self.rank != 0:
            addr = ctypes.create_string_buffer(bytes(t.tolist()), n)
            self.check(self.lib.xc_ccl_kvs_from(addr), "KVS from rank 0's address")
        self.check(self.lib.xc_ccl_comm(self.size, self.rank), "communicator")

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"oneCCL {what}: {self.lib.xc_ccl_error().decode(errors='replace')}")

    def all_reduce(self, t) -> None:
        """In-place sum over the ranks of a contiguous fp32 or bf16 CPU tensor."""
        if not t.is_contiguous():
            raise ValueError("ccl all_reduce needs a contiguous tensor")
        dtype = DTYPES[str(t.dtype).removeprefix("torch.")]
        self.check(self.lib.xc_ccl_allreduce_sum(t.data_ptr(), t.numel(), dtype), "allreduce")

    def hook(self, state, bucket):
        """DDP comm hook: the bucket's gradients summed by oneCCL and averaged, in a future. state.mode says how:
        "async" (default) hands the bucket to the one worker thread and returns at once, so the all-reduce overlaps
        the rest of the backward pass; "sync" all-reduces on the caller's thread and returns a completed future
        (blocks the backward pass); "gloo" is torch's default all-reduce hook over the gloo group, the reference
        the bench checks the other two against."""
        import torch

        mode = getattr(state, "mode", "async")
        if mode == "async":
            return self.start(bucket.buffer())
        if mode == "gloo":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            return default_hooks.allreduce_hook(None, bucket)
        if mode != "sync":
            raise ValueError(f"ccl hook mode {mode!r}: async, sync or gloo")
        buf = bucket.buffer()
        self.all_reduce(buf)
        buf.div_(self.size)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def start(self, t):
        """A future of t summed over the ranks and divided by their number, done on this process's one worker
        thread (started here once). One thread fed in call order keeps the order of collectives the same on every
        rank, as oneCCL requires; ctypes releases the GIL for the foreign call. An error is set on the future, so it
        reaches DDP's wait at the end of backward instead of leaving it waiting."""
        import torch

        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xc-ccl")
        fut: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            try:
                self.all_reduce(t)
                t.div_(self.size)
            except BaseException as e:  # noqa: BLE001 - whatever it is, DDP must see it rather than hang
                fut.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            else:
                fut.set_result(t)

        self.pool.submit(run)
        return fut

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        self.check(self.lib.xc_ccl_free(), "free")


def pattern(numel: int, scale: float, dtype):
    """A buffer whose values depend on position (1, 2, 3, 1, 2, 3, ...) x scale: a wrong sum, or a right sum in
    the wrong place, shows up when the ranks' patterns are summed."""
    import torch

    t = torch.full((numel,), scale, dtype=dtype)
    t[1::3] *= 2
    t[2::3] *= 3
    return t


def check_sum(all_reduce, t, rank: int, world: int) -> None:
    """All-reduce t, rank r's pattern x (r + 1), in place and compare it with the pattern x the sum of 1..world:
    exact in fp32 and bf16 (small integers). Raises where any element differs."""
    import torch

    all_reduce(t)
    want = pattern(t.numel(), world * (world + 1) / 2, t.dtype)
    if not torch.equal(t, want):
        bad = (t != want).nonzero()
        raise RuntimeError(f"all-reduce sum WRONG ({t.numel()} x {t.dtype}): {bad.numel()} elements differ, first "
                           f"at {int(bad[0])}: {float(t[bad[0]])} != {float(want[bad[0]])}")
