"""nox sessions for the llmsys workspace. `nox -l` lists them; `nox` runs lint and tests.

Every session covers all packages by default, or a selection passed after `--`:

    nox -s tests -- --package kernels-swiglu        # one package (repeatable)
    nox -s tests -- --affected-since origin/main    # changed packages and their dependents
    nox -s tests -- --package kernels-swiglu -k grad  # anything else goes to pytest

Packages are discovered from packages/* (skipping packages/_template); their sibling
dependencies are read from each pyproject.toml. Tests run in one shared environment
(.nox/dev) over every package's source, so torch is installed once per machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent / "tools"))

from llmsys_dev import envs, workspace
from llmsys_dev.isolation import check_isolation

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True
ROOT = Path(__file__).parent


def _selection(session: nox.Session) -> tuple[list[workspace.Package], list[str], bool]:
    """(packages, remaining posargs, whether the whole workspace was selected)."""
    names, since, rest = [], None, []
    args = iter(session.posargs)
    for arg in args:
        if arg == "--package":
            names.append(next(args))
        elif arg.startswith("--package="):
            names.append(arg.split("=", 1)[1])
        elif arg == "--affected-since":
            since = next(args)
        elif arg.startswith("--affected-since="):
            since = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    packages = workspace.select(names or None, since)
    if names:
        everything = False
    elif since is None:
        everything = True
    else:  # the workspace tooling's own tests run when something outside packages/ changed
        everything = any(not f.startswith("packages/") for f in workspace.changed_files(since))
    session.log("packages: " + (", ".join(p.name for p in packages) or "none affected"))
    return packages, rest, everything


def _host_has_cuda() -> bool:
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole workspace."""
    session.install(*envs.dev_requirements("lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """CPU tests (Triton under the interpreter), benchmark bodies once, isolation of each wheel."""
    packages, pytest_args, everything = _selection(session)
    isolate = "--no-isolation" not in pytest_args
    pytest_args = [arg for arg in pytest_args if arg != "--no-isolation"]
    python = envs.dev_env()
    env = envs.source_env()
    common = ["-m", "pytest", "-p", "no:cacheprovider", "--import-mode=importlib"]
    if everything:
        session.run(python, *common, "tools/tests", *pytest_args, env=env, external=True)
    for package in packages:
        paths = [p for p in (package.path / "tests", package.path / "benchmarks") if p.exists()]
        session.run(
            python, *common, *paths, "--benchmark-disable", *pytest_args, env=env, external=True
        )
    for package in packages if isolate else ():
        check_isolation(python, package)


@nox.session(venv_backend="none")
def isolation(session: nox.Session) -> None:
    """Each package's wheel alone in a fresh venv with only torch and triton runs its example."""
    packages, _, _ = _selection(session)
    python = envs.dev_env()
    for package in packages:
        check_isolation(python, package)


@nox.session(venv_backend="none")
def build(session: nox.Session) -> None:
    """Wheels and sdists of the selected packages into dist/."""
    packages, _, _ = _selection(session)
    python = envs.dev_env()
    for package in packages:
        session.run(
            python,
            "-m",
            "build",
            "--no-isolation",
            "--outdir",
            "dist",
            package.path,
            external=True,
        )


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """The main job: every package's sweep that applies here, one report under reports/.

    On a machine whose python has CUDA torch, that python runs the full GPU sweeps; elsewhere the
    shared CPU environment runs a small default under the Triton interpreter.
    """
    packages, rest, _ = _selection(session)
    selected = [arg for p in packages for arg in ("--package", p.name)]
    python = sys.executable if _host_has_cuda() else envs.dev_env()
    session.run(python, "tools/bench.py", *selected, *rest, env=envs.source_env(), external=True)


@nox.session(venv_backend="none")
def distributed(session: nox.Session) -> None:
    """Multi-process runs with torchrun: the ddp example on 2 ranks, then the ddp sweep.

    On a CPU-only machine 2 gloo ranks; on a host with 2 or more GPUs one NCCL rank per GPU
    (all-reduce on every rank count the host has, the xl strategy benchmark on 2 GPUs). Extra
    arguments go to the sweep (`-- --quick`).
    """
    python = sys.executable if _host_has_cuda() else envs.dev_env()
    env = envs.source_env()
    ddp = ROOT / "packages" / "ddp"
    torchrun = [python, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    session.run(*torchrun, ddp / "examples" / "smallest.py", env=env, external=True)
    sweep = ddp / "benchmarks" / "sweep.py"
    session.run(python, sweep, *session.posargs, env=env, external=True)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """GPU tests, benchmarks against the committed baselines, and sweeps (host python).

    Without nox on a GPU host: `python tools/gpu.py` does the same.
    """
    session.run(sys.executable, "tools/gpu.py", *session.posargs, external=True)


@nox.session(venv_backend="none")
def bench_compare(session: nox.Session) -> None:
    """pytest-benchmark run on this GPU against the committed baselines; >10% slower fails."""
    session.run(
        sys.executable,
        "tools/gpu.py",
        "--skip-tests",
        "--skip-sweep",
        *session.posargs,
        external=True,
    )
