"""The C launcher (``native_launch.c``), compiled at first use as Triton compiles its own driver
stub, and the per-kernel facts it needs.

``get()`` returns the loaded module, or None where it cannot be had (no C compiler, no Python
headers, ``LLMSYS_NATIVE_LAUNCH=0``): ``launch`` then calls Triton's ``CompiledKernel.run``, the
pure-Python fallback, which works everywhere and costs about 4 us more per launch.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch
import triton

SOURCE = Path(__file__).with_name("native_launch.c")
PLANS_SOURCE = Path(__file__).with_name("native_plans.cpp")
# Triton signature types -> native_launch.c's kinds (pointers, integers, floats, constexprs).
_KINDS = {"i1": "b", "i8": None, "i32": "i", "i64": "l", "u32": "I", "u64": "L"}
_KINDS |= {"fp32": "f", "f32": "f", "fp64": "d", "constexpr": "-"}
MAX_SHARED_BYTES = 228 * 1024  # above this Triton asks for an oversized-shared-memory launch


def cache_dir() -> Path:
    """Where the compiled module is kept: ``$LLMSYS_CACHE_DIR``, else ``~/.cache/llmsys``."""
    return Path(os.environ.get("LLMSYS_CACHE_DIR") or Path.home() / ".cache" / "llmsys")


def build(directory: Path | None = None) -> Path:
    """Compile ``native_launch.c`` into ``directory`` (default ``cache_dir()``) once per source
    and interpreter; returns the shared library's path."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    flags = ["-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}"]
    return _compile(SOURCE, compiler, flags, ["-ldl"], b"", directory)


def build_plans(directory: Path | None = None) -> Path:
    """Compile ``native_plans.cpp`` against this torch's headers and libraries (as
    ``torch.utils.cpp_extension`` would, without needing ninja) once per source, interpreter and
    torch; returns the shared library's path. About 20 s the first time."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O2", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    flags += [
        f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]
    flags += [f"-I{sysconfig.get_paths()['include']}", "-w"]  # torch's headers warn under c++17
    libraries = [f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch_python"]
    libraries.append(f"-Wl,-rpath,{root / 'lib'}")
    identity = f"{torch.__version__} {root}".encode()
    return _compile(PLANS_SOURCE, compiler, flags, libraries, identity, directory)


def _compile(source: Path, compiler, flags, libraries, identity: bytes, directory) -> Path:
    """Compile ``source`` into a Python extension in ``directory`` (default ``cache_dir()``),
    named by a hash of everything that goes into it; reused when it exists."""
    directory = cache_dir() if directory is None else directory
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("native_*.h")))
    text = source.read_bytes() + headers + suffix.encode() + identity + " ".join(flags).encode()
    tag = hashlib.sha256(text).hexdigest()[:16]
    target = directory / f"{source.stem}_{tag}{suffix}"
    if target.exists():
        return target
    if compiler is None:
        raise RuntimeError(f"no compiler for {source.name} (set CC and CXX, or install gcc)")
    directory.mkdir(parents=True, exist_ok=True)
    # One build at a time per cache (test workers starting together wait for the first).
    with open(directory / f"{source.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            built = Path(scratch) / target.name
            command = [compiler, *flags, str(source), "-o", str(built), *libraries]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
            os.replace(built, target)  # atomic: a reader never sees half a file
    return target


def load(path: Path, name: str = "native_launch"):
    """Import the extension module ``name`` from ``path``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def get():
    """The compiled ``native_launch`` module, or None (with one warning saying why)."""
    if os.environ.get("LLMSYS_NATIVE_LAUNCH", "1") == "0":
        return None
    try:
        module = load(build())
        module.init(
            torch.Tensor,
            getattr(torch._C, "_cuda_getDevice", None),  # None in a CPU-only build of torch
            getattr(torch._C, "_cuda_getCurrentRawStream", None),
            triton.knobs.runtime,
        )
        return module
    except Exception as error:  # any failure to build or load: the Python launch still works
        warnings.warn(
            f"llmsys.triton_launch: the C launcher is unavailable ({error}); kernels launch "
            "through Triton's CompiledKernel.run (about 4 us more per launch) and op calls test "
            "their arguments in Python",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def kinds(compiled, descriptors: bool = False) -> bytes | None:
    """``native_launch``'s kinds for a compiled kernel's arguments, or None when the kernel needs
    something only Triton's launcher does (scratch buffers, clusters, cooperative grids,
    programmatic dependent launch, tensor descriptors, 16-bit float scalars). With
    ``descriptors``, a host tensor descriptor the kernel lowered to TMA is kind ``T`` (recorded
    plans encode its tensor map themselves, plans.py)."""
    meta = compiled.metadata
    if (
        getattr(meta, "num_ctas", 1) != 1
        or getattr(meta, "launch_cooperative_grid", False)
        or getattr(meta, "launch_pdl", False)
        or getattr(meta, "global_scratch_size", 0)
        or getattr(meta, "profile_scratch_size", 0)
        or meta.shared > MAX_SHARED_BYTES
    ):
        return None
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(signature, dict):
        return None
    lowered = getattr(meta, "tensordesc_meta", None)  # one entry per descriptor, or None
    out = []
    for ty in signature.values():
        if descriptors and lowered and isinstance(ty, str) and ty.startswith("tensordesc"):
            out.append("T")
            continue
        kind = "p" if isinstance(ty, str) and ty.startswith("*") else _KINDS.get(ty)
        if kind is None:  # a tuple, a tensor descriptor, a 16-bit scalar: Triton's launcher
            return None
        out.append(kind)
    return "".join(out).encode()
