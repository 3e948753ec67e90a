"""Annotations where mypy cannot require them: the modules that hold ``@triton.jit`` kernels.

mypy (the lint session) requires every function of the packages' src to be annotated, but a
kernel's pointer and size arguments are untyped by design and mypy cannot exempt a function by
its decorator, so pyproject.toml switches the rule off for these modules. This test applies the
same rule to their other functions, read from the AST: every argument (but a method's ``self``
or ``cls``) and the return annotated.
"""

from __future__ import annotations

import ast
from pathlib import Path

from llmsys_dev import workspace

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def kernel_modules(root: Path = workspace.ROOT) -> list[Path]:
    """The source files of the modules whose mypy override allows untyped defs."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mypy"]
    names = [
        name
        for override in config["overrides"]
        if override.get("disallow_untyped_defs") is False
        for name in override["module"]
    ]
    paths = {p.import_name: p.path / "src" for p in workspace.discover(root).values()}
    files = []
    for name in names:
        package = ".".join(name.split(".")[:2])
        files.append(paths[package].joinpath(*name.split(".")).with_suffix(".py"))
    return files


def _is_triton_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) == "triton.jit"


def unannotated(source: str) -> list[str]:
    """``name (line N)`` of each function in ``source``, kernels aside, missing an annotation."""
    tree = ast.parse(source)
    methods = {
        id(item)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    missing = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if any(_is_triton_jit(d) for d in node.decorator_list):
            continue
        arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        arguments += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
        is_static = any(ast.unparse(d) == "staticmethod" for d in node.decorator_list)
        if id(node) in methods and not is_static and node.args.args:
            arguments.remove(node.args.args[0])  # self or cls
        if node.returns is None or any(a.annotation is None for a in arguments):
            missing.append(f"{node.name} (line {node.lineno})")
    return missing


def test_the_kernel_modules_exist():
    files = kernel_modules()
    assert files and all(f.exists() for f in files), [str(f) for f in files if not f.exists()]


def test_functions_beside_the_kernels_are_annotated():
    missing = {
        str(path.relative_to(workspace.ROOT)): names
        for path in kernel_modules()
        if (names := unannotated(path.read_text()))
    }
    assert not missing, f"annotate these (mypy does not check them): {missing}"


def test_the_rule_skips_kernels_and_self_but_not_a_missing_annotation():
    source = """
import triton

@triton.jit
def kernel(x_ptr, n):
    pass

@triton.jit(do_not_specialize=["n"])
def other_kernel(x_ptr, n):
    pass

class Layer:
    def forward(self, x: int) -> int:
        return x

    @staticmethod
    def forward_static(ctx, x: int) -> int:
        return x

def launcher(x: int, block) -> None:
    def inner(y: int):
        return y
"""
    assert sorted(unannotated(source)) == [
        "forward_static (line 17)",
        "inner (line 21)",
        "launcher (line 20)",
    ]
