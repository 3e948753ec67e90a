"""Prove a package stands alone: its wheel, installed into a fresh venv that has only torch and
triton, imports and runs its smallest example. Sibling packages it declares are installed from
their own wheels; anything else it forgot to declare makes the install or the example fail."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from .envs import ENVS, _pip, _run, make_venv
from .workspace import Package, discover, with_dependencies

WHEELS = ENVS / "wheels"
_built: dict[tuple[str, Path], Path] = {}  # wheels this process built: one nox run builds each once


def build_wheel(python: Path, package: Package, outdir: Path = WHEELS) -> Path:
    """Build ``package``'s wheel with ``python`` (which must have ``build`` and hatchling), or
    return the one this process built already (sessions of one run share their siblings')."""
    key = (package.name, outdir)
    if key in _built and _built[key].exists():
        return _built[key]
    outdir.mkdir(parents=True, exist_ok=True)
    for old in outdir.glob(f"{package.dist.replace('-', '_')}-*.whl"):
        old.unlink()
    _run([python, "-m", "build", "--wheel", "--no-isolation", "--outdir", outdir, package.path])
    (wheel,) = outdir.glob(f"{package.dist.replace('-', '_')}-*.whl")
    _built[key] = wheel
    return wheel


def check_isolation(dev_python: Path, package: Package) -> None:
    packages = discover()
    for name in sorted(with_dependencies(packages, {package.name})):
        build_wheel(dev_python, packages[name])
    python = make_venv(ENVS / "isolation" / package.name, with_pip=False)
    pip = [*_pip(dev_python), "--python", python]  # the dev env's pip, run by the venv's python
    _run([*pip, "install", "--no-index", "--find-links", WHEELS, package.dist])
    if not package.example:
        raise SystemExit(f"{package.name}: pyproject.toml has no [tool.llmsys] example to run")
    example = package.path / package.example
    with tempfile.TemporaryDirectory() as cwd:  # away from the source tree
        _run([python, "-I", example], cwd=cwd)
    listed = subprocess.run(
        [*pip, "list", "--format=freeze"], check=True, capture_output=True, text=True
    ).stdout
    print(f"{package.name}: isolated install OK; environment:\n{listed}")
