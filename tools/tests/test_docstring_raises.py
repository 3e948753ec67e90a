"""Every public callable's ``Raises:`` section says what its code raises (issue 49).

The public callables: the names in each package's ``__all__``
(``packages/*/src/llmsys/<pkg>/__init__.py``), the public functions and classes of the modules
it lists (``llmsys.triton_launch.checks``, ``llmsys.bench_harness.arguments``, ...), and the
public methods of those classes and of their llmsys base classes. A class's docstring documents
its constructor: the ``__init__`` (or a dataclass's ``__post_init__``) of the class and of its
llmsys bases, which it reaches through ``super().__init__``.

The rule, read from the AST of each callable's source (nothing is called):

(a) Each type under ``Raises:`` is raised somewhere reachable: in the callable's own body, or in
    the body of a function (or the constructor of a class) of llmsys that it calls directly,
    one level deep: its package's helpers, and the shared ones of another package (kernels-int8
    checks its inputs with kernels-fused's ``rms_norm.check_inputs``). In a body, a call into
    ``llmsys.triton_launch.checks`` counts as raising ``TypeError`` and ``ValueError``. Raising
    a subclass counts.
(b) Each type the body raises directly is under ``Raises:`` (itself or a base class); a callable
    that raises directly needs a ``Raises:`` section. Direct: ``raise Error(...)``,
    ``raise Error``, and ``raise factory(...)`` where ``factory`` is an error factory, a function
    whose ``return Error(...)`` builds the exception (``ops.inference_only_error``). Re-raises
    (``raise``, ``raise error``) are not direct, nor what a called helper raises: a helper's
    errors are the callable's to document where they are its contract, which (a) checks.

The bodies of nested functions and classes are not part of their callable's body: they run
later, if at all. Entries are read as Google-style ``Name: text`` or ``Name, Other: text``
lines; prose under ``Raises:`` that names no type ("Whatever the local step raises") documents
nothing. ``EXEMPT`` lists the intended mismatches, each with its reason.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import re
import textwrap
import types
from collections.abc import Iterator

from llmsys_dev import workspace

CHECKS = "llmsys.triton_launch.checks"
CHECKS_RAISE = (TypeError, ValueError)

# "<callable>": ({type names the rule would flag}, why the mismatch is intended). None is needed
# now; an entry must name a public callable.
EXEMPT: dict[str, tuple[set[str], str]] = {}


# ---- the docstring side --------------------------------------------------------------------


ENTRY = re.compile(r"([A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*)\s*:")


def raises_section(doc: str | None) -> list[str] | None:
    """The exception names of a Google-style ``Raises:`` section, None when there is none."""
    if not doc:
        return None
    lines = inspect.cleandoc(doc).splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "Raises:":
            continue
        indent = len(line) - len(line.lstrip())
        names, entry_indent = [], None
        for entry in lines[i + 1 :]:
            if not entry.strip():
                continue
            depth = len(entry) - len(entry.lstrip())
            if depth <= indent:
                break  # the next section, or prose after the list
            entry_indent = depth if entry_indent is None else entry_indent
            match = ENTRY.match(entry.strip())
            if depth == entry_indent and match:
                names += [n.strip() for n in match[1].split(",")]
        return names
    return None


# ---- the code side -------------------------------------------------------------------------


def package_of(obj) -> str:
    """``llmsys.<pkg>`` for an object defined in one of the packages, else its module."""
    module = getattr(obj, "__module__", None) or ""
    return ".".join(module.split(".")[:2]) if module.startswith("llmsys.") else module


@functools.cache
def body_nodes(fn: types.FunctionType) -> list[ast.AST] | None:
    """The AST nodes of ``fn``'s body, without those of nested functions and classes; None where
    the source cannot be read (generated code: a dataclass's ``__init__``)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source).body[0]
    if not isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None  # a lambda assigned to a name
    nodes, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        nodes.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(ast.iter_child_nodes(node))
    return nodes


def resolve(node: ast.AST, fn: types.FunctionType, owner: type | None):
    """What a name or a dotted name in ``fn``'s body refers to, None when it is not a global
    (a local variable, ``error`` in ``raise error``) or not a plain attribute chain.
    ``self.x`` and ``cls.x`` look in the class that defines ``fn``, ``super().x`` in its bases."""
    if isinstance(node, ast.Name):
        if node.id in ("self", "cls") and owner is not None:
            return owner
        if node.id in fn.__code__.co_varnames:
            return None  # an argument or a local variable
        if node.id in fn.__globals__:
            return fn.__globals__[node.id]
        return getattr(builtins, node.id, None)
    if isinstance(node, ast.Attribute):
        value = node.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super" and owner:
            for base in owner.__mro__[1:]:  # ``super().x``: the next class that defines x
                if node.attr in vars(base):
                    return vars(base)[node.attr]
            return None
        base = resolve(value, fn, owner)
        if base is None:
            return None
        try:
            return inspect.getattr_static(base, node.attr)
        except AttributeError:
            return None
    return None


def function_of(obj) -> types.FunctionType | None:
    """The plain function behind a function, static or class method, or decorated function."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    obj = inspect.unwrap(obj) if callable(obj) else obj
    return obj if isinstance(obj, types.FunctionType) else None


def is_exception_class(obj) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseException)


@functools.cache
def factory_types(fn: types.FunctionType) -> frozenset[type]:
    """What an error factory returns: the exception classes its ``return X(...)`` build."""
    found = set()
    for node in body_nodes(fn) or ():
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
            made = resolve(node.value.func, fn, None)
            if is_exception_class(made):
                found.add(made)
    return frozenset(found)


def raised_type(node: ast.Raise, fn, owner) -> set[type]:
    """The classes a ``raise`` statement raises directly, empty for a re-raise."""
    value = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    if value is None:
        return set()  # a bare ``raise``
    target = resolve(value, fn, owner)
    if is_exception_class(target):
        return {target}
    factory = function_of(target)
    if isinstance(node.exc, ast.Call) and factory is not None:
        return set(factory_types(factory))
    return set()


def raised_directly(fn: types.FunctionType, owner: type | None) -> set[type]:
    """The exception classes ``fn``'s own body raises, re-raises left out."""
    found = set()
    for node in body_nodes(fn) or ():
        if isinstance(node, ast.Raise):
            found |= raised_type(node, fn, owner)
    return found


def constructor(cls: type) -> list[tuple[types.FunctionType, type]]:
    """The ``__init__`` and ``__post_init__`` of ``cls`` and of its llmsys bases, which each
    subclass's ``__init__`` reaches through ``super().__init__``."""
    found = []
    for base in cls.__mro__:
        for name in ("__init__", "__post_init__"):
            fn = function_of(vars(base).get(name))
            if fn is not None and package_of(base).startswith(("llmsys", cls.__module__)):
                found.append((fn, base))
    return found


def calls(fn: types.FunctionType, owner: type | None) -> Iterator[tuple[object, type | None]]:
    """What ``fn``'s body calls, resolved (None where it cannot be), with the class to look up
    ``self.x`` in for the callee."""
    for node in body_nodes(fn) or ():
        if isinstance(node, ast.Call):
            callee = resolve(node.func, fn, owner)
            via_self = isinstance(node.func, ast.Attribute) and owner is not None
            yield callee, owner if via_self else None


def raises(fn: types.FunctionType, owner: type | None) -> set[type]:
    """What ``fn``'s own body raises: directly, and TypeError and ValueError for a ``checks``
    call."""
    found = raised_directly(fn, owner)
    for callee, _ in calls(fn, owner):
        target = function_of(callee)
        if target is not None and target.__module__ == CHECKS:
            found |= set(CHECKS_RAISE)
    return found


def reachable(fn: types.FunctionType, owner: type | None) -> set[type]:
    """What ``fn`` raises, plus what the functions and constructors of llmsys (or of ``fn``'s
    own module) that it calls raise (one level)."""
    found = raises(fn, owner)
    ours = ("llmsys", package_of(owner or fn))
    for callee, callee_owner in calls(fn, owner):
        if isinstance(callee, type) and package_of(callee).startswith(ours):
            for init, base in constructor(callee):
                found |= raises(init, base)
        elif (target := function_of(callee)) is not None and package_of(target).startswith(ours):
            found |= raises(target, callee_owner)
    return found


# ---- the check -----------------------------------------------------------------------------


def name_to_class(name: str, fn: types.FunctionType):
    """A documented exception name (``ValueError``, ``argparse.ArgumentTypeError``) as its
    class, or its last part where it is not in ``fn``'s module's scope."""
    first, *rest = name.split(".")
    found = fn.__globals__.get(first, getattr(builtins, first, None))
    for part in rest:
        found = getattr(found, part, None)
    return found if is_exception_class(found) else name.rsplit(".", 1)[-1]


def covers(documented, raised: type) -> bool:
    if isinstance(documented, str):
        return any(c.__name__ == documented for c in raised.__mro__)
    return issubclass(raised, documented)


def mismatches(doc: str | None, parts: list[tuple[types.FunctionType, type | None]]) -> list[str]:
    """What breaks the rule for one callable whose code is ``parts`` (a function, or a class's
    constructor functions) and whose docstring is ``doc``."""
    names = raises_section(doc)
    direct, reach = set(), set()
    for fn, owner in parts:
        direct |= raised_directly(fn, owner)
        reach |= reachable(fn, owner)
    if names is None:
        return [f"raises {c.__name__} but has no Raises: section" for c in sorted_(direct)]
    documented = [name_to_class(n, parts[0][0]) for n in names]
    problems = [
        f"documents {label(d)}, which it does not raise"
        for d in documented
        if not any(covers(d, r) for r in reach)
    ]
    problems += [
        f"raises {r.__name__}, not under Raises:"
        for r in sorted_(direct)
        if not any(covers(d, r) for d in documented)
    ]
    return problems


def label(documented) -> str:
    return documented if isinstance(documented, str) else documented.__name__


def sorted_(classes) -> list[type]:
    return sorted(classes, key=lambda c: c.__name__)


# ---- the public callables ------------------------------------------------------------------


def package_modules() -> list[types.ModuleType]:
    names = sorted(package.import_name for package in workspace.discover().values())
    return [importlib.import_module(name) for name in names]


def public_names(module: types.ModuleType) -> list[str]:
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    ]


def class_members(cls: type) -> Iterator[tuple[str, types.FunctionType, type]]:
    """The public methods (and property accessors) of ``cls`` and its llmsys bases."""
    for base in cls.__mro__:
        if not package_of(base).startswith("llmsys"):
            continue
        for name, value in vars(base).items():
            if name.startswith("_"):
                continue
            accessors = (
                [value.fget, value.fset, value.fdel] if isinstance(value, property) else [value]
            )
            for accessor in accessors:
                fn = function_of(accessor)
                if fn is not None:
                    yield f"{base.__qualname__}.{name}", fn, base


@functools.cache
def public_callables() -> dict[str, tuple[str | None, list]]:
    """``{"llmsys.pkg.name": (docstring, [(function, defining class or None), ...])}``."""
    found, seen = {}, set()

    def add(qualified: str, key: object, doc: str | None, parts: list) -> None:
        if parts and key not in seen:  # an alias (``ShardPlan = Ownership``) is checked once
            seen.add(key)
            found[qualified] = (doc, parts)

    def visit(module: types.ModuleType, prefix: str) -> None:
        for name in public_names(module):
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                if package_of(obj) == package_of(module):
                    visit(obj, f"{prefix}{name}.")
            elif isinstance(obj, type) and package_of(obj).startswith("llmsys"):
                init = [(fn, base) for fn, base in constructor(obj)]
                init_docs = [obj.__doc__] + [fn.__doc__ for fn, _ in init]
                add(f"{prefix}{name}", obj, "\n".join(d for d in init_docs if d), init)
                for member, fn, base in class_members(obj):
                    add(f"{package_of(base)}.{member}", fn, fn.__doc__, [(fn, base)])
            elif (fn := function_of(obj)) is not None and package_of(fn).startswith("llmsys"):
                add(f"{prefix}{name}", fn, fn.__doc__, [(fn, None)])

    for module in package_modules():
        visit(module, f"{module.__name__}.")
    return found


# ---- the tests -----------------------------------------------------------------------------


def _documented_and_raised(x):
    """Doubles.

    Raises:
        TypeError: ``x`` is not an int.
        ValueError, KeyError: never.
    """
    if not isinstance(x, int):
        raise TypeError("x")
    error = LookupError("later")
    if x < 0:
        raise error  # a re-raise of a local: not direct
    if x > 10:
        raise OSError(x)
    return 2 * x


def _returns_error(what: str) -> RuntimeError:
    return RuntimeError(what)


def _raises_value_error(x) -> None:
    if x is None:
        raise ValueError("x")


def _helped(x):
    """Checks, in helpers.

    Raises:
        ValueError: ``x`` is None.
        RuntimeError: ``x`` is negative.
    """
    _raises_value_error(x)
    if x < 0:
        raise _returns_error("x")

    def later():
        raise KeyError(x)  # a nested function's body is not this one's

    return later


def test_the_section_parser_reads_names_and_skips_prose():
    assert raises_section(_documented_and_raised.__doc__) == ["TypeError", "ValueError", "KeyError"]
    assert raises_section("Short.\n\nRaises:\n    Whatever the step raises (a sparse\n") == []
    doc = "Short.\n\nRaises:\n    ValueError: a\n        line: not an entry.\n\nReturns:\n    x\n"
    assert raises_section(doc) == ["ValueError"]
    assert raises_section("No section.") is None


def test_the_check_finds_both_directions():
    parts = [(_documented_and_raised, None)]
    assert raised_directly(_documented_and_raised, None) == {TypeError, OSError}
    assert mismatches(_documented_and_raised.__doc__, parts) == [
        "documents ValueError, which it does not raise",
        "documents KeyError, which it does not raise",
        "raises OSError, not under Raises:",
    ]
    assert mismatches(None, parts) == [
        "raises OSError but has no Raises: section",
        "raises TypeError but has no Raises: section",
    ]


def test_the_check_follows_helpers_and_factories_one_level():
    assert raised_directly(_helped, None) == {RuntimeError}  # the factory's; not the nested one
    assert reachable(_helped, None) == {RuntimeError, ValueError}
    # A test module is its own "package" here (package_of is its module name).
    assert mismatches(_helped.__doc__, [(_helped, None)]) == []


class _Base:
    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("size")


class _Sub(_Base):
    """A subclass whose constructor is its base's too.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: as ``_Base``.
    """

    def __init__(self, size: int, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError("name")
        super().__init__(size)

    def grow(self, by: int) -> None:
        """Grows.

        Raises:
            ValueError: ``by`` is below 1 (the constructor's check).
        """
        super().__init__(by)


def test_a_class_documents_its_constructor_and_its_bases():
    assert [fn.__qualname__ for fn, _ in constructor(_Sub)] == ["_Sub.__init__", "_Base.__init__"]
    assert mismatches(_Sub.__doc__, constructor(_Sub)) == []
    assert mismatches(None, constructor(_Sub)) == [
        "raises TypeError but has no Raises: section",
        "raises ValueError but has no Raises: section",
    ]
    assert reachable(_Sub.grow, _Sub) == {ValueError}  # through super().__init__


def test_a_checks_call_counts_as_type_and_value_errors():
    from llmsys.kernels_int8 import quantize_int8

    assert reachable(quantize_int8, None) >= {TypeError, ValueError}


def test_every_public_raises_section_matches_the_code():
    problems = []
    for name, (doc, parts) in public_callables().items():
        exempt, _why = EXEMPT.get(name, (set(), ""))
        problems += [
            f"{name}: {p}" for p in mismatches(doc, parts) if not any(e in p for e in exempt)
        ]
    assert problems == [], "\n".join(problems)


def test_every_package_and_exemption_is_covered():
    callables = public_callables()
    packages = {n.split(".")[1] for n in callables}
    assert packages == {m.__name__.split(".")[1] for m in package_modules()}
    assert len(callables) > 150
    assert set(EXEMPT) <= set(callables)
