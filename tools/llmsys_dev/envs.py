"""The environments nox sessions run in, built so torch is installed once per machine.

    .nox/torch-base/   torch + triton from constraints/cpu.txt, a plain `pip --target` folder
    .nox/dev/          the shared test environment: a venv that sees torch-base through a .pth
                       file, plus the root pyproject's `dev` dependency group
    .nox/isolation/X   a fresh venv per package that sees torch-base and nothing else

Each is rebuilt only when the files it was built from change (a hash stamp).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .workspace import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ENVS = ROOT / ".nox"
CONSTRAINTS = ROOT / "constraints" / "cpu.txt"
BASE = ENVS / "torch-base"
DEV = ENVS / "dev"


def _run(cmd: list[str], **kwargs) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(list(map(str, cmd)), check=True, **kwargs)


def _stamp_ok(folder: Path, digest: str) -> bool:
    return (folder / ".llmsys-stamp").exists() and (folder / ".llmsys-stamp").read_text() == digest


def _digest(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _pip(python: Path | str) -> list[str]:
    return [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]


def dev_requirements(group: str = "dev") -> list[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(meta["dependency-groups"][group])


def torch_base() -> Path:
    """Install torch and triton (CPU) once into .nox/torch-base; returns the folder."""
    digest = _digest(CONSTRAINTS.read_text(), sys.version)
    if not _stamp_ok(BASE, digest):
        shutil.rmtree(BASE, ignore_errors=True)
        pins = [line.split("#")[0].strip() for line in CONSTRAINTS.read_text().splitlines()]
        _run([*_pip(sys.executable), "install", "--target", BASE, *filter(None, pins)])
        (BASE / ".llmsys-stamp").write_text(digest)
    return BASE


def python_of(env: Path) -> Path:
    return env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def make_venv(
    env: Path, *, requirements: list[str] = (), with_pip: bool = True, base: Path | None = None
) -> Path:
    """A fresh venv at ``env`` that sees torch-base (``base``, or else ``torch_base()``, built
    first if need be); returns its python. Without pip, another environment's pip installs into
    it (``pip --python``), which saves seconds per venv."""
    base = torch_base() if base is None else base
    shutil.rmtree(env, ignore_errors=True)
    venv.EnvBuilder(with_pip=with_pip).create(env)
    python = python_of(env)
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "llmsys-torch-base.pth").write_text(str(base) + "\n")
    if with_pip:
        # ensurepip's own setuptools (Python < 3.12) would shadow torch-base's newer one, which
        # torch requires: leave the venv with pip alone.
        _run([*_pip(python), "uninstall", "-y", "setuptools"])
    if requirements:
        _run([*_pip(python), "install", "-c", CONSTRAINTS, *requirements])
    return python


def dev_env() -> Path:
    """The shared test environment; returns its python."""
    requirements = dev_requirements("dev")
    digest = _digest(CONSTRAINTS.read_text(), sys.version, *requirements)
    if not _stamp_ok(DEV, digest):
        # torch-base installs beside the dev requirements (none of which needs torch): each pip
        # keeps about one core busy, so on a fresh 2-core machine this takes ~1 min, not ~2.
        with ThreadPoolExecutor(max_workers=1) as pool:
            base = pool.submit(torch_base)
            make_venv(DEV, requirements=[*requirements, "hatchling>=1.24"], base=BASE)
            base.result()
        (DEV / ".llmsys-stamp").write_text(digest)
    return python_of(DEV)


def source_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables that put every package's source and the tools on PYTHONPATH."""
    from .workspace import source_paths

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*source_paths(), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.update(extra or {})
    return env
