"""Each package README's Install section, generated from its ``pyproject.toml``.

The packages are not on PyPI, so a package installs from the checkout together with the
siblings it needs, named by path (pip then never looks them up on an index). A CPU line first
installs torch's CPU build, so the resolver finds torch satisfied and never pulls CUDA wheels.
"""

from __future__ import annotations

from pathlib import Path

from .workspace import ROOT, Package, _requirement_name, discover, topological_order

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

START, END = "<!-- install -->", "<!-- /install -->"
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def _extras(package: Package) -> dict[str, list[str]]:
    meta = tomllib.loads((package.path / "pyproject.toml").read_text())
    return meta.get("project", {}).get("optional-dependencies", {})


def _needs_triton(package: Package) -> bool:
    meta = tomllib.loads((package.path / "pyproject.toml").read_text())
    return any(_requirement_name(r) == "triton" for r in meta["project"].get("dependencies", []))


def _closure(packages: dict[str, Package], names: set[str]) -> list[str]:
    selected, stack = set(names), list(names)
    while stack:
        for dep in packages[stack.pop()].deps:
            if dep not in selected:
                selected.add(dep)
                stack.append(dep)
    return [name for name in topological_order(packages) if name in selected]


def pip_line(packages: dict[str, Package], package: Package, extras: tuple[str, ...] = ()) -> str:
    """``pip install ./packages/<dep> ... ./packages/<name>[extras]``, dependencies first."""
    needed = {package.name}
    for extra in extras:
        for requirement in _extras(package)[extra]:
            name = _requirement_name(requirement)
            if name.startswith("llmsys-"):
                needed.add(name.removeprefix("llmsys-"))
    paths = []
    for name in _closure(packages, needed):
        path = f"./packages/{name}"
        if name == package.name and extras:
            path = f"'{path}[{','.join(extras)}]'"  # quoted: zsh would glob the brackets
        paths.append(path)
    return "pip install " + " ".join(paths)


def section(packages: dict[str, Package], package: Package) -> str:
    lines = [
        START,
        "## Install",
        "",
        "The packages are not on PyPI: install from a checkout, in its root folder. The first",
        "line installs torch's CPU build (a CPU-only machine then never downloads the CUDA",
        "wheels); skip it on a GPU host whose torch is installed. Where PyTorch's CPU index",
        "cannot be reached, [the root README](../../README.md#install) says what happens. The",
        "second names the sibling packages this one needs by path:",
        "",
        "<!-- install-command -->",
        "```",
        CPU_TORCH,
        pip_line(packages, package),
        "```",
        "<!-- /install-command -->",
        "",
    ]
    for extra, requirements in _extras(package).items():
        what = ", ".join(requirements)
        lines.append(f"- with `[{extra}]` ({what}): `{pip_line(packages, package, (extra,))}`")
    example = f"python packages/{package.name}/{package.example}"
    if _needs_triton(package):
        lines.append(
            f"- check it: `{example}` (on a CPU, `TRITON_INTERPRET=1 {example}` runs the Triton"
            " kernels under Triton's interpreter; `nox -s isolation` runs this install command"
            " and that example in a fresh venv)"
        )
    else:
        lines.append(
            f"- check it: `{example}` (`nox -s isolation` runs this install command and that"
            " example in a fresh venv)"
        )
    lines.append(END)
    return "\n".join(lines)


def generate(root: Path = ROOT) -> dict[Path, str]:
    packages = discover(root)
    texts = {}
    for package in packages.values():
        path = package.path / "README.md"
        text = path.read_text()
        new = section(packages, package)
        if START in text:
            head, rest = text.split(START, 1)
            text = head + new + rest.split(END, 1)[1]
        else:  # first run: before the first second-level heading
            head, sep, rest = text.partition("\n## ")
            text = head.rstrip("\n") + "\n\n" + new + "\n" + sep + rest if sep else text + new
        texts[path] = text
    return texts
