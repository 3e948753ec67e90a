"""Prove a package installs the way its README says and stands alone.

The README's install command (between ``<!-- install-command -->`` markers) runs as written, from
the repository root, in a fresh venv that sees only the CPU torch and triton of torch-base: so
the command's CPU torch line finds torch already there, and every other requirement (siblings
from the checkout, numpy, ...) must come from what the command names or what the packages
declare. Then the package's smallest example runs from a folder away from the source tree under
``TRITON_INTERPRET=1`` (the CPU path every kernel README documents), and the environment must
hold no CUDA wheel (``nvidia-*``).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from .envs import ENVS, _run, make_venv
from .workspace import ROOT, Package

START, END = "<!-- install-command -->", "<!-- /install-command -->"


def install_command(package: Package) -> str:
    """The shell lines between the README's install-command markers (fences dropped)."""
    text = (package.path / "README.md").read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{package.name}: README.md has no {START} ... {END} block")
    block = text.split(START, 1)[1].split(END, 1)[0]
    lines = [line for line in block.strip().splitlines() if not line.startswith("```")]
    return "\n".join(lines)


def check_isolation(dev_python: Path, package: Package) -> None:
    """Run ``package``'s README install command in a fresh venv, then its example."""
    del dev_python  # the venv has its own pip: the command is run as a user would paste it
    env_dir = ENVS / "isolation" / package.name
    python = make_venv(env_dir, with_pip=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(env_dir)
    command = install_command(package)
    print(f"{package.name}: the README's install command, in {env_dir}:\n{command}", flush=True)
    subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=ROOT, env=env, check=True)
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    cuda = [line for line in listed.splitlines() if line.lower().startswith("nvidia-")]
    if cuda:
        raise SystemExit(f"{package.name}: the install command pulled CUDA wheels: {cuda}")
    _check_shipped_files(python, package)
    if not package.example:
        raise SystemExit(f"{package.name}: pyproject.toml has no [tool.llmsys] example to run")
    example = package.path / package.example
    with tempfile.TemporaryDirectory() as cwd:  # away from the source tree
        _run([python, "-I", example], cwd=cwd, env={**env, "TRITON_INTERPRET": "1"})
    print(f"{package.name}: README install + example OK; environment:\n{listed}")


# What every distribution must carry: the license text and the PEP 561 marker that tells type
# checkers the package is typed.
SHIPPED = ("LICENSE", "py.typed")


def _check_shipped_files(python: Path, package: Package) -> None:
    """The installed distribution holds a LICENSE file and a ``py.typed`` marker."""
    probe = (
        "import sys; from importlib.metadata import distribution; "
        "print('\\n'.join(f.name for f in distribution(sys.argv[1]).files))"
    )
    names = subprocess.run(
        [python, "-I", "-c", probe, package.dist], check=True, capture_output=True, text=True
    ).stdout.split()
    missing = [name for name in SHIPPED if name not in names]
    if missing:
        raise SystemExit(f"{package.name}: the installed distribution lacks {missing}")


def main(argv: list[str] | None = None) -> None:
    """``python -m llmsys_dev.isolation PACKAGE``: the check for one package, as a process of
    its own, so the noxfile's tests session runs it beside that package's pytest run."""
    import argparse

    from .workspace import discover

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("package", choices=sorted(discover()))
    args = parser.parse_args(argv)
    check_isolation(Path(), discover()[args.package])


if __name__ == "__main__":
    main()
