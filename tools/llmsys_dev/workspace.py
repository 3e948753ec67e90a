"""Discover packages under ``packages/`` and select the ones a run should cover.

The rule is mechanical: directory ``packages/<name>`` is distribution ``llmsys-<name>`` and import
``llmsys.<name with - as _>``. Dependencies on siblings are read from each package's
``pyproject.toml``, so adding a package needs no edit here or in the noxfile.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DIST_PREFIX = "llmsys-"


@dataclasses.dataclass(frozen=True)
class Package:
    name: str  # directory name, e.g. "kernels-swiglu"
    path: Path
    deps: tuple[str, ...]  # sibling package names this one depends on
    example: str | None  # the smallest example, relative to path

    @property
    def dist(self) -> str:
        return DIST_PREFIX + self.name

    @property
    def import_name(self) -> str:
        return "llmsys." + self.name.replace("-", "_")


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s;\[<>=!~(]", requirement.strip(), maxsplit=1)[0].lower()


def read_package(path: Path) -> Package:
    meta = tomllib.loads((path / "pyproject.toml").read_text())
    requirements = meta.get("project", {}).get("dependencies", [])
    deps = tuple(
        sorted(
            name.removeprefix(DIST_PREFIX)
            for name in map(_requirement_name, requirements)
            if name.startswith(DIST_PREFIX)
        )
    )
    example = meta.get("tool", {}).get("llmsys", {}).get("example")
    return Package(name=path.name, path=path, deps=deps, example=example)


def discover(root: Path = ROOT) -> dict[str, Package]:
    """All packages, by name; folders starting with '.' or '_' (packages/.template) are skipped."""
    found = {}
    for path in sorted((root / "packages").iterdir()):
        if (
            path.is_dir()
            and not path.name.startswith((".", "_"))
            and (path / "pyproject.toml").exists()
        ):
            found[path.name] = read_package(path)
    for package in found.values():
        missing = set(package.deps) - set(found)
        if missing:
            raise ValueError(f"{package.name} depends on unknown packages: {sorted(missing)}")
    return found


def topological_order(packages: dict[str, Package]) -> list[str]:
    """Names ordered so that every package comes after its dependencies."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ValueError(f"dependency cycle through {name}")
        visiting.add(name)
        for dep in packages[name].deps:
            visit(dep)
        visiting.discard(name)
        order.append(name)

    for name in sorted(packages):
        visit(name)
    return order


def with_dependents(packages: dict[str, Package], names: set[str]) -> set[str]:
    """``names`` plus every package that depends on one of them, transitively."""
    selected = set(names)
    changed = True
    while changed:
        changed = False
        for package in packages.values():
            if package.name not in selected and selected.intersection(package.deps):
                selected.add(package.name)
                changed = True
    return selected


def with_dependencies(packages: dict[str, Package], names: set[str]) -> set[str]:
    """``names`` plus everything they depend on, transitively."""
    selected = set(names)
    stack = list(names)
    while stack:
        for dep in packages[stack.pop()].deps:
            if dep not in selected:
                selected.add(dep)
                stack.append(dep)
    return selected


def changed_files(since: str, root: Path = ROOT) -> list[str]:
    """Files changed between ``since`` and the working tree (committed or not)."""
    out = subprocess.run(
        ["git", "diff", "--name-only", since, "--"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    untracked = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return sorted(set(out.split()) | set(untracked.split()))


def affected(packages: dict[str, Package], files: list[str]) -> set[str]:
    """Packages a change to ``files`` can break: the touched ones and their dependents.

    A change outside ``packages/`` (tooling, constraints, CI) affects every package.
    """
    touched = set()
    for file in files:
        parts = Path(file).parts
        if len(parts) >= 2 and parts[0] == "packages":
            if parts[1] in packages:
                touched.add(parts[1])
            # the template and deleted packages affect nothing
        elif parts and parts[0] not in ("docs",) and not file.endswith(".md"):
            return set(packages)
    return with_dependents(packages, touched)


def select(names: list[str] | None = None, affected_since: str | None = None) -> list[Package]:
    """Packages to run, in dependency order: all by default, the named ones, or the affected."""
    packages = discover()
    chosen = set(packages)
    if names:
        unknown = set(names) - set(packages)
        if unknown:
            raise SystemExit(f"unknown package(s) {sorted(unknown)}; known: {sorted(packages)}")
        chosen = set(names)
    if affected_since:
        chosen &= affected(packages, changed_files(affected_since))
    return [packages[name] for name in topological_order(packages) if name in chosen]


def source_paths(root: Path = ROOT) -> list[str]:
    """``packages/*/src`` and ``tools``: what PYTHONPATH needs to run everything from source."""
    return [str(p.path / "src") for p in discover(root).values()] + [str(root / "tools")]
