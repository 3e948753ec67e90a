"""The native module (``native_plans.cpp``, the replay of recorded plans), compiled at first use
against the installed torch, as Triton compiles its own driver stub."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("native_plans.cpp")


def cache_dir() -> Path:
    """Where the compiled module is kept: ``$LLMSYS_CACHE_DIR``, else ``~/.cache/llmsys``."""
    return Path(os.environ.get("LLMSYS_CACHE_DIR") or Path.home() / ".cache" / "llmsys")


def build(directory: Path | None = None) -> Path:
    """Compile ``native_plans.cpp`` into ``directory`` (default ``cache_dir()``) against this
    torch's headers and libraries (as ``torch.utils.cpp_extension`` would, without needing ninja),
    once per source, interpreter and torch; returns the shared library's path. About 20 s the
    first time."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O2", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    flags += [
        f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]
    flags += [f"-I{sysconfig.get_paths()['include']}", "-w"]  # torch's headers warn under c++17
    libraries = [f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch_python", "-ldl"]
    libraries.append(f"-Wl,-rpath,{root / 'lib'}")
    directory = cache_dir() if directory is None else directory
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    identity = f"{torch.__version__} {root} {suffix} {' '.join(flags)}".encode()
    tag = hashlib.sha256(SOURCE.read_bytes() + identity).hexdigest()[:16]
    target = directory / f"{SOURCE.stem}_{tag}{suffix}"
    if target.exists():
        return target
    if compiler is None:
        raise RuntimeError(f"no compiler for {SOURCE.name} (set CXX, or install g++)")
    directory.mkdir(parents=True, exist_ok=True)
    # One build at a time per cache (test workers starting together wait for the first).
    with open(directory / f"{SOURCE.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            built = Path(scratch) / target.name
            command = [compiler, *flags, str(SOURCE), "-o", str(built), *libraries]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
            os.replace(built, target)  # atomic: a reader never sees half a file
    return target


def load(path: Path) -> ModuleType:
    """Import the ``native_plans`` extension module from ``path``."""
    spec = importlib.util.spec_from_file_location("native_plans", path)
    assert spec is not None and spec.loader is not None  # an extension suffix gets both
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
