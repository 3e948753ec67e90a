"""Package discovery, the dependency graph and change-based selection, on synthetic workspaces."""

from pathlib import Path

import pytest

from llmsys_dev import workspace


def make_package(root: Path, name: str, deps: list[str] = ()) -> None:
    path = root / "packages" / name
    path.mkdir(parents=True)
    requirements = ", ".join(f'"llmsys-{d}>=0.1"' for d in deps)
    path.joinpath("pyproject.toml").write_text(
        f'[project]\nname = "llmsys-{name}"\ndependencies = ["torch>=2.6", {requirements}]\n'
    )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    make_package(tmp_path, "kernels-swiglu")
    make_package(tmp_path, "ddp")
    make_package(tmp_path, "profiling", ["kernels-swiglu", "ddp"])
    make_package(tmp_path, ".template")
    return tmp_path


def test_discover_reads_names_and_sibling_dependencies(root):
    packages = workspace.discover(root)
    assert sorted(packages) == ["ddp", "kernels-swiglu", "profiling"]  # .template skipped
    assert packages["profiling"].deps == ("ddp", "kernels-swiglu")
    assert packages["kernels-swiglu"].deps == ()
    assert packages["kernels-swiglu"].dist == "llmsys-kernels-swiglu"
    assert packages["kernels-swiglu"].import_name == "llmsys.kernels_swiglu"


def test_unknown_sibling_is_an_error(root):
    make_package(root, "broken", ["does-not-exist"])
    with pytest.raises(ValueError, match="does-not-exist"):
        workspace.discover(root)


def test_topological_order_puts_dependencies_first(root):
    order = workspace.topological_order(workspace.discover(root))
    assert order.index("profiling") > order.index("ddp")
    assert order.index("profiling") > order.index("kernels-swiglu")


def test_cycle_is_reported(root):
    make_package(root, "a", ["b"])
    make_package(root, "b", ["a"])
    with pytest.raises(ValueError, match="cycle"):
        workspace.topological_order(workspace.discover(root))


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (["packages/kernels-swiglu/src/x.py"], {"kernels-swiglu", "profiling"}),
        (["packages/profiling/README.md"], {"profiling"}),
        (["packages/ddp/tests/test_x.py", "README.md"], {"ddp", "profiling"}),
        (["noxfile.py"], {"ddp", "kernels-swiglu", "profiling"}),
        (["packages/.template/pyproject.toml"], set()),
        ([], set()),
    ],
)
def test_affected_is_touched_packages_plus_dependents(root, files, expected):
    assert workspace.affected(workspace.discover(root), files) == expected


def test_with_dependencies_closes_over_siblings(root):
    packages = workspace.discover(root)
    assert workspace.with_dependencies(packages, {"profiling"}) == {
        "profiling",
        "ddp",
        "kernels-swiglu",
    }


def test_the_real_workspace_is_consistent():
    packages = workspace.discover()
    assert "kernels-swiglu" in packages
    for package in packages.values():
        assert (package.path / "src" / "llmsys" / package.import_name.split(".")[1]).is_dir()
        assert not (package.path / "src" / "llmsys" / "__init__.py").exists()  # PEP 420
        assert package.example and (package.path / package.example).is_file()
        assert (package.path / "README.md").is_file()
        assert (package.path / "CHANGELOG.md").is_file()


def test_every_package_carries_the_license_and_a_typed_marker():
    """Each distribution is built from its package folder, so each folder holds the root's
    LICENSE (hatchling ships it under the wheel's dist-info/licenses) and a py.typed marker."""
    license_text = (workspace.ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    for package in workspace.discover().values():
        assert (package.path / "LICENSE").read_text() == license_text, package.name
        module = package.path / "src" / "llmsys" / package.import_name.split(".")[1]
        assert (module / "py.typed").is_file(), package.name
