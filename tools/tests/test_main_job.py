"""The main job survives sweeps that start spawned worker processes.

A spawned worker re-runs the parent's main script as ``__mp_main__`` (multiprocessing's spawn
start method). The int8 sweep's parallel precompile does that; when ``tools/bench.py`` ran the
main job at import, every worker ran every sweep again on the GPU and the pool broke.
"""

import ast
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(  # what is run as a program (test files are imported by pytest instead)
    path
    for path in [*ROOT.glob("tools/*.py"), *ROOT.glob("packages/*/benchmarks/*.py")]
    if not path.name.startswith("test_")
)


def test_a_worker_spawned_under_the_main_job_does_not_rerun_it(monkeypatch):
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__spec__", None, raising=False)  # spawn then runs __file__
    monkeypatch.setattr(main, "__file__", str(ROOT / "tools" / "bench.py"), raising=False)
    # The worker inherits pytest's argv: a main job run in it would exit with a usage error.
    worker = multiprocessing.get_context("spawn").Process(target=os.getpid)
    worker.start()
    worker.join(timeout=120)
    if worker.is_alive():
        worker.kill()
        pytest.fail("the spawned worker hung")
    assert worker.exitcode == 0


def _side_effects(path: Path, root: Path = ROOT) -> list[str]:
    """What a script does at import, outside its main guard: calls made as statements (other
    than setting up sys.path), and calls anywhere of its own functions or of sys.exit."""
    tree = ast.parse(path.read_text())
    own = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    found = []
    for node in tree.body:
        if isinstance(node, (ast.If, ast.FunctionDef, ast.ClassDef)):
            continue  # the `if __name__ == "__main__":` guard, and what only runs when called
        statement = node.value if isinstance(node, ast.Expr) else None
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            name = ast.unparse(call.func)
            if (call is statement and not name.startswith("sys.path.")) or name in own | {
                "sys.exit"
            }:
                found.append(f"{path.relative_to(root)}:{call.lineno}: {name}()")
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_do_their_work_only_under_the_main_guard(script):
    assert _side_effects(script) == []


def test_the_check_sees_an_unguarded_call(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text("import sys\n\ndef main():\n    return 0\n\nsys.exit(main())\n")
    assert len(_side_effects(script, root=tmp_path)) == 2
    imported = tmp_path / "other.py"
    imported.write_text("import sys\nfrom report import main\n\nsys.path.insert(0, '.')\nmain()\n")
    assert _side_effects(imported, root=tmp_path) == ["other.py:5: main()"]


def test_report_from_committed_results_links_them_instead_of_copying(tmp_path):
    from llmsys_dev.main_job import main

    assert main(["--from-results", "h100", "--out", str(tmp_path), "--package", "kernels-moe"]) == 0
    report = tmp_path / "h100" / "REPORT.md"
    assert [p.name for p in report.parent.iterdir()] == ["REPORT.md"]
    committed = ROOT / "packages" / "kernels-moe" / "benchmarks" / "results" / "h100.csv"
    link = os.path.relpath(committed, report.parent)
    text = report.read_text()
    assert f"CSV: [`{link}`]({link})" in text and f"]({link[:-4]}.png)" in text
    assert "| moe_permute |" in text


@pytest.mark.parametrize(
    "package", sorted(p.parents[1].name for p in ROOT.glob("packages/*/benchmarks/sweep.py"))
)
def test_every_sweep_loads_as_the_main_job_loads_it(package):
    # A sweep defining a dataclass failed here on a GPU host: the module was not registered in
    # sys.modules while it ran.
    from llmsys_dev.main_job import load_sweep

    sweep = load_sweep(ROOT / "packages" / package)
    assert callable(sweep.run)


def test_a_cpu_report_links_the_committed_gpu_results_instead_of_copying_them(tmp_path):
    from llmsys_dev.main_job import committed_gpu_links, load_sweep
    from llmsys_dev.workspace import discover

    package = discover()["kernels-moe"]
    text = committed_gpu_links([(package, load_sweep(package.path))], tmp_path)
    assert "[`h100.csv`](" in text and "reports/h100/REPORT.md" in text
    assert not any(line.startswith("|") for line in text.splitlines())  # no table copied
    for target in re.findall(r"\]\(([^)#]+)", text):
        assert (tmp_path / target).resolve().exists(), target


def test_a_sweeps_output_goes_to_its_log_from_python_cpp_and_children(tmp_path, capfd):
    from llmsys_dev.main_job import output_to

    log = tmp_path / "sweep.log"
    with output_to(log):
        print("from python", file=sys.__stdout__)  # pytest's capture replaces sys.stdout
        os.write(2, b"USDT: from the C++ side\n")
        subprocess.run([sys.executable, "-c", "print('from a worker')"], check=True)
    print("after")
    assert log.read_text().splitlines() == [
        "from python",
        "USDT: from the C++ side",
        "from a worker",
    ]
    assert capfd.readouterr().out == "after\n"
