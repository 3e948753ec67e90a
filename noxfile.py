"""nox sessions for the llmsys workspace. `nox -l` lists them; `nox` runs lint and tests.

`tests`, `isolation` and `build` are parametrized by package (`tests(package='tools')` is the
workspace tooling's own tests), so one runs alone as `nox -s "tests(package='kernels-swiglu')"`.
Every session covers all packages by default, or a selection passed after `--`:

    nox -s tests -- --package kernels-swiglu        # one package (repeatable); the rest skip
    nox -s tests -- --affected-since origin/main    # changed packages and their dependents
    nox -s tests -- --package kernels-swiglu -k grad  # anything else goes to pytest

Packages are discovered from packages/* (skipping packages/.template); their sibling
dependencies are read from each pyproject.toml. Tests run in one shared environment
(.nox/dev) over every package's source, so torch is installed once per machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent / "tools"))

from llmsys_dev import envs, workspace
from llmsys_dev.isolation import check_isolation

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True
ROOT = Path(__file__).parent


PACKAGES = [p.name for p in workspace.select()]  # in dependency order
TOOLS = "tools"  # the workspace tooling's own tests, under tools/tests
# Suites that pytest-xdist shortens, one worker per core: their time goes to single-threaded
# Python (the Triton interpreter, small models, README blocks in subprocesses). Measured on 2
# shared cores: kernels-moe 111 s -> 80 s, flash-attn2 85 s -> 68 s, profiling 78 s -> 59 s,
# kernels-int8 40 s -> 34 s, tools 74 s -> 54 s, kernels-fused 66 s -> 48 s. The others run
# alone: suites that spawn rank processes already keep the cores busy (ddp 131 s -> 182 s,
# sharded-optim 31 s -> 36 s), and for short ones starting the workers costs more than it saves
# (triton-launch 8 s -> 12 s, kernels-swiglu 20 s -> 23 s). hf, since it holds every model
# rewrite's tests: 101 s -> 68 s.
PARALLEL = {TOOLS, "flash-attn2", "hf", "kernels-fused", "kernels-int8", "kernels-moe", "profiling"}


def _selection(session: nox.Session) -> tuple[list[workspace.Package], list[str], bool]:
    """(packages, remaining posargs, whether the workspace tooling is selected too)."""
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
    named_packages = [name for name in names if name != TOOLS]
    if names and not named_packages:  # only the tooling
        packages = []
    else:
        packages = workspace.select(named_packages or None, since)
    if names:
        tooling = TOOLS in names
    elif since is None:
        tooling = True
    else:  # the workspace tooling's own tests run when something outside packages/ changed
        tooling = any(not f.startswith("packages/") for f in workspace.changed_files(since))
    return packages, rest, tooling


def _selected(session: nox.Session, name: str) -> tuple[workspace.Package | None, list[str]]:
    """This parametrization's package (None for the tooling) and the pytest arguments; skips
    the session, saying so, when the posargs' selection leaves it out."""
    packages, rest, tooling = _selection(session)
    chosen = {p.name: p for p in packages}
    if (name == TOOLS and not tooling) or (name != TOOLS and name not in chosen):
        session.skip(f"{name} is not in this run's selection ({' '.join(session.posargs)})")
    return chosen.get(name), rest


def _host_has_cuda() -> bool:
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def _skip_without_gpu(session: nox.Session) -> None:
    if not _host_has_cuda():
        session.skip(
            "no CUDA GPU here (the host python's torch sees none); `nox -s tests` runs CPU tests"
        )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole workspace, then mypy over every
    package's src (the settings are in pyproject.toml's [tool.mypy])."""
    session.install(*envs.dev_requirements("lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    packages = workspace.select()
    # mypy reads torch, numpy and the rest from the test environment, the packages from source.
    session.run(
        "mypy",
        "--python-executable",
        str(envs.dev_env()),
        *(arg for p in packages for arg in ("-p", p.import_name)),
        env={"MYPYPATH": os.pathsep.join(str(p.path / "src") for p in packages)},
    )


@nox.session(venv_backend="none")
@nox.parametrize("package", [TOOLS, *PACKAGES])
def tests(session: nox.Session, package: str) -> None:
    """CPU tests (Triton under the interpreter), benchmark bodies once, isolation of the wheel."""
    selected, pytest_args = _selected(session, package)
    isolate = "--no-isolation" not in pytest_args
    pytest_args = [arg for arg in pytest_args if arg != "--no-isolation"]
    python = envs.dev_env()
    # The five slowest tests of each session are printed: what to look at when CI grows.
    common = ["-m", "pytest", "-p", "no:cacheprovider", "--import-mode=importlib", "--durations=5"]
    if package in PARALLEL:
        common += ["-n", "auto"]  # a `-n 0` among the posargs comes later and wins
    if selected is None:
        paths = ["tools/tests"]
    else:
        folders = (selected.path / "tests", selected.path / "benchmarks")
        paths = [*(p for p in folders if p.exists()), "--benchmark-disable"]
    if selected is None or not isolate:
        session.run(python, *common, *paths, *pytest_args, env=envs.source_env(), external=True)
        return
    # The isolation check (pip and one example run: mostly one core) runs beside pytest, its
    # output kept until pytest is done; the session fails if either fails.
    with tempfile.TemporaryFile("w+") as log:
        check = _start_isolation(selected, log)
        try:
            session.run(python, *common, *paths, *pytest_args, env=envs.source_env(), external=True)
        finally:
            code = check.wait()
            log.seek(0)
            session.log(f"{selected.name}: isolation check (ran beside pytest):\n{log.read()}")
    if code != 0:
        session.error(f"{selected.name}: the isolation check failed (exit code {code})")


def _start_isolation(package: workspace.Package, log) -> subprocess.Popen:
    """``check_isolation`` for ``package`` in a process of its own, writing to ``log``."""
    envs.torch_base()  # built (if need be) before pytest starts, not raced by both
    env = {**envs.source_env(), "PYTHONPATH": str(ROOT / "tools")}
    command = [sys.executable, "-m", "llmsys_dev.isolation", package.name]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@nox.session(venv_backend="none")
@nox.parametrize("package", PACKAGES)
def isolation(session: nox.Session, package: str) -> None:
    """The package's wheel alone in a fresh venv with only torch and triton runs its example."""
    selected, _ = _selected(session, package)
    check_isolation(envs.dev_env(), selected)


@nox.session(venv_backend="none")
@nox.parametrize("package", PACKAGES)
def build(session: nox.Session, package: str) -> None:
    """The package's wheel and sdist into dist/."""
    selected, _ = _selected(session, package)
    python = envs.dev_env()
    session.run(
        python, "-m", "build", "--no-isolation", "--outdir", "dist", selected.path, external=True
    )


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """The main job: every package's sweep that applies here, one report under reports/.

    On a machine whose python has CUDA torch, that python runs the full GPU sweeps; elsewhere the
    shared CPU environment runs a small default under the Triton interpreter.
    """
    packages, rest, _ = _selection(session)
    session.log("packages: " + (", ".join(p.name for p in packages) or "none affected"))
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
    _skip_without_gpu(session)
    session.run(sys.executable, "tools/gpu.py", *session.posargs, external=True)


@nox.session(venv_backend="none")
def bench_compare(session: nox.Session) -> None:
    """pytest-benchmark run on this GPU against the committed baselines; >10% slower fails."""
    _skip_without_gpu(session)
    session.run(
        sys.executable,
        "tools/gpu.py",
        "--skip-tests",
        "--skip-sweep",
        *session.posargs,
        external=True,
    )
