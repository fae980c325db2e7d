"""The jobs' own CPU kernels (kernels.c beside this file), built at first use with the node's gcc for the node's
CPU (-march=native, ~0.6 s) into a cache keyed by the source, the compiler and the CPU, and loaded with ctypes.
Without gcc, or with XC_NATIVE_KERNELS=0, lib() is None and callers keep torch's path.

The library is built with -fopenmp: its libgomp.so.1 is the one torch has already loaded (same soname), so its
parallel loops run on torch's OpenMP threads rather than on a second pool spinning beside them."""
from __future__ import annotations

import collections
import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("training.speed.native")

SOURCE = Path(__file__).with_name("kernels.c")
# -ffp-contract=off: no fused multiply-adds but those written, so results match torch's kernels bit for bit
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
ENV = "XC_NATIVE_KERNELS"

_lib: ctypes.CDLL | None = None
_tried = False
# each caller asks for its kernel by name, so that a bench can time the job with one of them off
# attn and gelu were deleted: on an AMX Xeon they saved under 3% of a step (docs/benchmarks.md)
KERNELS = ("dropout", "output", "adamw")
_off: frozenset[str] = frozenset()
_why = ""  # why _load() gave None
_paths: dict[str, collections.Counter] = {}  # kernel -> calls by path, for report()


class Chunk(ctypes.Structure):
    _fields_ = [("tensor", ctypes.c_int64), ("begin", ctypes.c_int64), ("end", ctypes.c_int64)]


class AdamWCoef(ctypes.Structure):
    _fields_ = [("keep", ctypes.c_float), ("step_size", ctypes.c_float), ("bc2_sqrt", ctypes.c_float)]


_P, _I64, _F, _D, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double, ctypes.c_int
_PP = ctypes.POINTER(ctypes.c_void_p)
# kernels.c's functions and their C signatures, all in one place beside it (every one returns void)
SIGNATURES = {
    "xc_adamw_bf16": [_PP, _PP, _PP, _PP, _PP, ctypes.POINTER(AdamWCoef), ctypes.POINTER(Chunk), _I64, _D, _D, _D,
                      _F, _INT],
    **{f"xc_dropout_{t}_forward": [_P, _P, _P, _I64, ctypes.c_uint64, ctypes.c_uint32, _F, _INT]
       for t in ("bf16", "f32")},
    **{f"xc_dropout_{t}_backward": [_P, _P, _P, _I64, _F, _INT] for t in ("bf16", "f32")},
    "xc_sumsq_bf16": [_PP, ctypes.POINTER(Chunk), _I64, _P, _INT],
    "xc_dense_out_bf16_forward": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, ctypes.c_uint64,
                                  ctypes.c_uint32, _F, _F, _INT],
    "xc_dense_out_bf16_backward": [_P, _P, _P, _P, _P, _P, _F, _P, _P, _P, _P, _P, _P, _I64, _I64, _INT],
}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xeon-cluster" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        return ""


def build(cc: str = "gcc") -> Path:
    """The built library's path, building it unless the cache has it. Raises OSError or CalledProcessError."""
    exe = shutil.which(cc)
    if exe is None:
        raise FileNotFoundError(f"{cc} not found")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags()]).encode())
    out = cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # ranks sharing a node may build at once: each writes its own file and renames it into place
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([exe, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, check=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def lib(kernel: str | None = None) -> ctypes.CDLL | None:
    """The kernels, or None (logged once) where they cannot be built or XC_NATIVE_KERNELS=0 turns them off;
    None too where kernel is one that off() holds. A named kernel's answer is tallied for report()."""
    got, why = (None, "off in this bench") if kernel in _off else (_load(), _why)
    if kernel is not None:
        took(kernel, "native" if got is not None else f"torch: {why}")
    return got


def _load() -> ctypes.CDLL | None:
    global _lib, _tried, _why
    if _tried:
        return _lib
    _tried = True
    if os.environ.get(ENV, "1") == "0":
        _why = f"{ENV}=0"
        return None
    import torch  # noqa: F401  (its libgomp first: the library's OpenMP calls resolve to it)

    try:
        _lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        detail = detail.strip().splitlines()[-1] if detail.strip() else type(e).__name__
        _why = f"the library could not be built or loaded ({detail}); install gcc to get it"
        log.warning("native kernels unavailable (%s): torch's own ops instead (install gcc to get them)", detail)
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(_lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return _lib


def why() -> str:
    """Why lib() gave None ('' while it has not)."""
    return _why


def took(kernel: str, path: str) -> None:
    """Tally one call of kernel by path: 'native', 'torch: <why>' where the kernel would have run but could not,
    or 'torch (<why>)' where it does not apply (a caller that decides before lib(): an fp32 block, say)."""
    _paths.setdefault(kernel, collections.Counter())[path] += 1


def report() -> dict[str, str]:
    """{kernel: path} for results.json's speed (see took()), or each path with its share of the calls where a
    run took more than one. A kernel no training step asked for is left out."""
    out = {}
    for kernel in KERNELS:
        paths = _paths.get(kernel)
        if paths:
            total = sum(paths.values())
            out[kernel] = (next(iter(paths)) if len(paths) == 1 else
                           "; ".join(f"{p} ({100 * n / total:.0f}% of calls)" for p, n in paths.most_common()))
    return out


def reset() -> None:
    """Forget the loaded library's state and the tally (tests switching XC_NATIVE_KERNELS)."""
    global _lib, _tried, _why
    _lib, _tried, _why = None, False, ""
    _paths.clear()



@contextlib.contextmanager
def off(*kernels: str):
    """lib() answers None inside, for the named kernels (all of them if none is named): torch's path, for a bench
    that times both paths in one process."""
    global _off
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        raise ValueError(f"no native kernel {min(unknown)}; the kernels: {', '.join(KERNELS)}")
    saved = _off
    _off = frozenset(kernels or KERNELS)
    try:
        yield
    finally:
        _off = saved
