"""The jobs' own CPU kernels (kernels.c beside this file), built at first use with the node's gcc for the node's
CPU (-march=native, ~0.6 s) into a cache keyed by the source, the compiler and the CPU, and loaded with ctypes.
Without gcc, or with XC_NATIVE_KERNELS=0, lib() is None and callers keep torch's path.

The library is built with -fopenmp: its libgomp.so.1 is the one torch has already loaded (same soname), so its
parallel loops run on torch's OpenMP threads rather than on a second pool spinning beside them."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("training.native")

SOURCE = Path(__file__).with_name("kernels.c")
# -ffp-contract=off: no fused multiply-adds but those written, so results match torch's kernels bit for bit
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
ENV = "XC_NATIVE_KERNELS"

_lib: ctypes.CDLL | None = None
_tried = False


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
    **{f"xc_attn_{t}_forward": [_P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F, _P, _P, _P, _I64, ctypes.c_uint64,
                                ctypes.c_uint32, _F, _INT] for t in ("bf16", "bf16_f32", "f32")},
    **{f"xc_attn_{t}_backward": [_P, _P, _P, _I64, _I64, _F, _F, _P, _INT] for t in ("bf16", "bf16_f32", "f32")},
    "xc_sumsq_bf16": [_PP, ctypes.POINTER(Chunk), _I64, _P, _INT],
    "xc_bias_gelu_bf16_forward": [_P, _P, _P, _P, _I64, _I64, _INT],
    "xc_gelu_bf16_backward": [_P, _P, _P, _P, _P, _I64, _I64, _INT],
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


def lib() -> ctypes.CDLL | None:
    """The kernels, or None (logged once) where they cannot be built or XC_NATIVE_KERNELS=0 turns them off."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get(ENV, "1") == "0":
        return None
    import torch  # noqa: F401  (its libgomp first: the library's OpenMP calls resolve to it)

    try:
        _lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("native kernels unavailable (%s): torch's own ops instead (install gcc to get them)",
                    detail.strip().splitlines()[-1] if detail.strip() else type(e).__name__)
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(_lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return _lib


def reset() -> None:
    """Forget the loaded library's state (tests switching XC_NATIVE_KERNELS)."""
    global _lib, _tried
    _lib, _tried = None, False
