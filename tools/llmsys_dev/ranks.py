"""Run a test function on N ranks of `torch.distributed`, the way `torchrun` would, with a timeout.

Distributed tests use it through the root conftest's ``run_ranks`` fixture:

    def check_broadcast(rank: int, world_size: int, size: int) -> None:  # module level
        ...                                                               # asserts, on every rank

    def test_broadcast(run_ranks):
        run_ranks(check_broadcast, world_size=2, size=7)

Each rank is a fresh Python process with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT on a free port). It loads the function's file by path (so test modules
need not be importable by name), joins the process group (gloo on CPU, or the ``backend`` asked
for), calls ``fn(rank, world_size, **kwargs)`` and leaves the group. A rank that raises makes the
whole run fail with every rank's output; a rank still running after ``timeout`` seconds (a
collective waiting for a peer that will never come) is killed and the run fails saying so. No
test can hang CI.

Spawning ranks costs seconds (each imports torch), so a test module with several checks on the
same world size can run them in turn in one process group, once, from a module-scoped fixture:

    CHECKS = {"broadcast": (check_broadcast, {"size": 7}), "gather": (check_gather, {})}

    @pytest.fixture(scope="module")
    def two_ranks():
        return run_in_turn(CHECKS, world_size=2)

    def test_broadcast(two_ranks):
        two_ranks.check("broadcast")  # raises that check's RankFailure, with its traceback

Every check starts from the default dtype and random state its group's processes started with. A
failed check stops the group; the checks after it run in a fresh group, so each has its verdict.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path


class RankFailure(AssertionError):
    """One or more ranks raised, exited non-zero or ran past the timeout."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    fn: Callable[..., object],
    world_size: int = 2,
    *,
    timeout: float = 120.0,
    backend: str = "gloo",
    **kwargs: object,
) -> None:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` processes; raise if any fails."""
    if not callable(fn) or fn.__name__ != fn.__qualname__:
        raise TypeError(f"fn must be a module-level function, got {fn!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        job = Path(scratch, "job.pkl")
        job.write_bytes(pickle.dumps((inspect.getfile(fn), fn.__name__, backend, kwargs)))
        procs = []
        for rank in range(world_size):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            log = open(Path(scratch, f"rank{rank}.log"), "w+")  # noqa: SIM115 (closed below)
            cmd = [sys.executable, __file__, str(job)]
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log), log))
        problems = _wait(procs, timeout)
        outputs = []
        for rank, (proc, log) in enumerate(procs):
            log.seek(0)
            outputs.append(f"----- rank {rank} (exit code {proc.returncode}) -----\n{log.read()}")
            log.close()
    if problems:
        raise RankFailure("; ".join(problems) + "\n" + "\n".join(outputs))


def _wait(procs: list, timeout: float) -> list[str]:
    """Wait for every rank; once one fails, give the others a few seconds, then kill them."""
    deadline = time.monotonic() + timeout
    after_failure = False
    while None in (codes := [p.poll() for p, _ in procs]):  # every rank polled each pass
        if not after_failure and any(code not in (None, 0) for code in codes):
            after_failure = True  # peers may be stuck in a collective waiting for it
            deadline = min(deadline, time.monotonic() + 10.0)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    stuck = [rank for rank, (p, _) in enumerate(procs) if p.poll() is None]
    for rank in stuck:
        procs[rank][0].kill()
        procs[rank][0].wait()
    failed = [rank for rank, (p, _) in enumerate(procs) if p.returncode != 0 and rank not in stuck]
    problems = [f"rank(s) {failed} failed"] if failed else []
    if stuck:
        why = "10 s after a peer failed" if after_failure else f"after the {timeout:g} s timeout"
        problems.append(f"rank(s) {stuck} still running {why}; killed")
    return problems


class InTurn:
    """What ``run_in_turn`` found: the failure of each check that failed, by name."""

    def __init__(self, names: list[str], failures: dict[str, RankFailure]) -> None:
        self.names, self.failures = names, failures

    def check(self, name: str) -> None:
        """Raise the check's failure, if it failed."""
        if name not in self.names:
            raise KeyError(f"no check named {name!r}; there are {self.names}")
        if name in self.failures:
            raise self.failures[name]


def run_in_turn(
    checks: dict[str, tuple[Callable[..., object], dict[str, object]]],
    world_size: int = 2,
    *,
    timeout: float = 300.0,
    backend: str = "gloo",
) -> InTurn:
    """Run each ``name: (fn, kwargs)`` check as ``fn(rank, world_size, **kwargs)``, one after
    another in one process group of ``world_size`` ranks (``timeout`` for the whole group)."""
    for fn, _ in checks.values():
        if not callable(fn) or fn.__name__ != fn.__qualname__:
            raise TypeError(f"each check must be a module-level function, got {fn!r}")
    failures: dict[str, RankFailure] = {}
    pending = list(checks.items())
    while pending:
        calls = [(inspect.getfile(fn), fn.__name__, kwargs) for _, (fn, kwargs) in pending]
        with tempfile.TemporaryDirectory() as marks:
            try:
                run_ranks(
                    _in_turn, world_size, timeout=timeout, backend=backend, calls=calls, marks=marks
                )
                failure = None
            except RankFailure as error:
                failure = error
            passed = 0  # checks that every rank finished
            while passed < len(pending) and all(
                Path(marks, f"{passed}.{rank}").exists() for rank in range(world_size)
            ):
                passed += 1
        if failure is None:
            break
        failed = pending[min(passed, len(pending) - 1)][0]
        before = [name for name, _ in pending[:passed]]
        failures[failed] = RankFailure(
            f"check {failed!r} failed (after {before} in the same process group): {failure}"
        )
        pending = pending[passed + 1 :]
    return InTurn(list(checks), failures)


def _in_turn(rank: int, world_size: int, calls: list, marks: str) -> None:
    """Rank side of ``run_in_turn``: each check from the same state, a mark once it passed."""
    import torch
    import torch.distributed as dist

    dtype, random_state = torch.get_default_dtype(), torch.random.get_rng_state()
    for index, (path, name, kwargs) in enumerate(calls):
        torch.set_default_dtype(dtype)
        torch.random.set_rng_state(random_state)
        _load(path, name)(rank, world_size, **kwargs)
        dist.barrier()
        Path(marks, f"{index}.{rank}").touch()


_loaded: dict[str, object] = {}  # test files this rank imported, by path


def _load(path: str, name: str) -> Callable[..., object]:
    """The function ``name`` of the file at ``path``, which is imported once per process."""
    if path not in _loaded:
        spec = importlib.util.spec_from_file_location(f"_ranks_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(Path(path).parent))  # siblings of the test file import as in pytest
        spec.loader.exec_module(module)
        _loaded[path] = module
    return getattr(_loaded[path], name)


def _rank_main(job_file: str) -> None:
    import torch.distributed as dist

    path, name, backend, kwargs = pickle.loads(Path(job_file).read_bytes())
    fn = _load(path, name)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "nccl":
        import torch

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    exit_code = 0
    try:
        fn(rank, world_size, **kwargs)
        dist.barrier()  # nobody tears down while a peer still talks to it (gloo aborted, -6)
    except BaseException:
        traceback.print_exc()
        exit_code = 1
    finally:
        dist.destroy_process_group()
    # The rank's work and its checks are done: leave without the interpreter's teardown, where
    # torch 2.13 with gloo aborted about one exit in five ("terminate called without an active
    # exception", exit code -6), after the barrier and destroy_process_group alike.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    _rank_main(sys.argv[1])
