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
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


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


def cpu_index_reachable(url: str = CPU_INDEX, timeout: float = 5.0) -> bool:
    """Whether torch's CPU wheel index answers within ``timeout`` seconds (one try: pip's own
    retries spend about 2 minutes on a host it cannot reach)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def torch_install_command(pins: list[str], target: Path, *, cpu_index: bool) -> list[str]:
    """The pip command that installs ``pins`` into ``target``. With ``cpu_index``, torch's CPU
    index is searched beside pip's own: ``torch==2.13.0`` then resolves to ``2.13.0+cpu`` (a
    local version sorts above the plain one) while triton still comes from pip's index."""
    index = ["--extra-index-url", CPU_INDEX] if cpu_index else []
    return [*_pip(sys.executable), "install", "--target", str(target), *index, *pins]


def has_cuda_build(folder: Path) -> bool:
    """Whether the torch in ``folder`` is a CUDA build: those pull in the nvidia-* wheels."""
    return (folder / "nvidia").is_dir() or any(folder.glob("torch-*+cu*.dist-info"))


def machine_has_gpu() -> bool:
    return Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None


def torch_base() -> Path:
    """Install torch and triton (CPU) once into .nox/torch-base; returns the folder.

    torch comes from its CPU index where that index answers; where it does not, from pip's
    configured index and wheel folders, which on Linux without a local CPU wheel is the CUDA
    build (several GB): said before the install and, on a machine with no GPU, after it."""
    digest = _digest(CONSTRAINTS.read_text(), sys.version)
    if not _stamp_ok(BASE, digest):
        shutil.rmtree(BASE, ignore_errors=True)
        pins = [line.split("#")[0].strip() for line in CONSTRAINTS.read_text().splitlines()]
        reachable = cpu_index_reachable()
        if not reachable:
            print(
                f"note: torch's CPU index ({CPU_INDEX}) did not answer within 5 s; installing "
                "torch from pip's own index and wheel folders instead (on Linux without a local "
                "CPU wheel that is the CUDA build, several GB)",
                flush=True,
            )
        _run(torch_install_command([p for p in pins if p], BASE, cpu_index=reachable))
        if has_cuda_build(BASE) and not machine_has_gpu():
            print(
                "\n" + "!" * 78 + f"\nWARNING: {BASE} holds a CUDA build of torch on a machine "
                "with no GPU.\nThe tests run on it, but it takes several GB. For the CPU build, "
                f"make {CPU_INDEX}\nreachable (or put a torch CPU wheel in a pip --find-links "
                "folder), delete\n.nox/torch-base and run again.\n" + "!" * 78,
                flush=True,
            )
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
