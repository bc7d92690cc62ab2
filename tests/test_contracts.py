"""Every public function documents its contract as torch does: ``Args:``, ``Returns:``, ``Raises:``.

Public: a name in a module's ``__all__``, and the methods a public class defines itself (not
underscored, not a property; an override without a docstring has its base's). A function that
takes arguments needs an ``Args:`` section; one that returns something (an annotation other than
None, or a ``return`` with a value), a ``Returns:`` (a generator: ``Yields:``). A class whose
constructor takes arguments documents them in ``Args:``. ``Raises:`` cannot be checked this way:
reviewers check it against the code.

To cover another package, add it to ``PACKAGES``.

    pytest tests/test_contracts.py -q
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import textwrap

import pytest

PACKAGES = ["dplab.reference"]  # dplab.backends joins once its exports are documented
# modules another branch is documenting now (sim2): listed here so nothing is skipped silently
PENDING = {"dplab.reference.cluster", "dplab.reference.flops"}


def modules(package: str) -> list[str]:
    """Every module of ``package``, the package itself included, in name order."""
    root = importlib.import_module(package)
    names = [package] + [m.name for m in pkgutil.walk_packages(root.__path__, package + ".")]
    return sorted(n for n in names if n not in PENDING)


def public_functions(module_name: str) -> list[tuple[str, object]]:
    """(qualified name, function) for the module's ``__all__`` functions and its public classes'
    own methods."""
    module = importlib.import_module(module_name)
    out = []
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name)
        if getattr(obj, "__module__", None) != module_name:
            continue  # re-exported: checked where it is defined
        if inspect.isfunction(inspect.unwrap(obj)):  # lru_cache'd ones too
            out.append((f"{module_name}.{name}", obj))
        elif inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                if inspect.isfunction(fn) and fn.__qualname__.startswith(obj.__qualname__ + "."):
                    out.append((f"{module_name}.{name}.{attr}", fn))
    return out


def _body_returns(fn: object) -> tuple[bool, bool]:
    """(returns a value, yields a value), read from the function's own body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    returns = yields = False
    stack = list(ast.iter_child_nodes(tree.body[0]))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue  # a nested function's returns are its own
        value = getattr(node, "value", None)
        if isinstance(value, ast.Constant) and value.value is None:
            value = None  # ``return None``: nothing returned
        if isinstance(node, ast.Return) and value is not None:
            returns = True
        if isinstance(node, (ast.Yield, ast.YieldFrom)) and value is not None:
            yields = True
        stack.extend(ast.iter_child_nodes(node))
    return returns, yields


def missing_sections(fn: object) -> list[str]:
    """The sections ``fn``'s docstring lacks, by what its signature and body say it needs."""
    doc = inspect.getdoc(fn) or ""  # an override without one has its base's (inspect finds it)
    fn = inspect.unwrap(fn)  # a context manager's generator: its own signature and body
    if not doc:
        return ["a docstring"]

    def has(section: str) -> bool:
        return re.search(rf"^{section}:\s*$", doc, re.M) is not None

    sig = inspect.signature(fn)
    params = [p for p in sig.parameters if p not in ("self", "cls")]
    annotation = sig.return_annotation
    says_returns = annotation not in (inspect.Signature.empty, None, "None", "NoReturn")
    returns, yields = _body_returns(fn)
    if inspect.isgeneratorfunction(fn):
        says_returns = False  # Iterator[...]: what it yields is the contract
    missing = []
    if params and not has("Args"):
        missing.append("Args")
    if (says_returns or returns) and not has("Returns"):
        missing.append("Returns")
    if yields and not (has("Yields") or has("Returns")):
        missing.append("Yields")
    return missing


def public_classes(module_name: str) -> list[tuple[str, type]]:
    """(qualified name, class) for the classes in the module's ``__all__`` (errors aside: their
    docstring says when they are raised)."""
    module = importlib.import_module(module_name)
    out = []
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name)
        if (inspect.isclass(obj) and obj.__module__ == module_name
                and not issubclass(obj, BaseException)):
            out.append((f"{module_name}.{name}", obj))
    return out


def class_missing(cls: type) -> list[str]:
    """What ``cls``'s docstring lacks: a constructor that takes arguments documents them in the
    docstring of the class that defines it (torch's way: ``Args:`` on the class)."""
    if not cls.__doc__:
        return ["a docstring"]
    if getattr(cls, "_is_protocol", False):
        return []  # a Protocol is never constructed
    owner = next(c for c in cls.__mro__ if "__init__" in vars(c) or "__new__" in vars(c))
    if owner.__module__ in ("builtins", "typing", "abc"):
        return []  # object's constructor, or a Protocol's: nothing of ours to document
    params = [p for p in inspect.signature(cls).parameters]
    return ["Args"] if params and "Args:" not in (owner.__doc__ or "") else []


CASES = [case for package in PACKAGES for module in modules(package)
         for case in public_functions(module)]
CLASSES = [case for package in PACKAGES for module in modules(package)
           for case in public_classes(module)]


def test_the_walk_finds_the_api() -> None:
    names = {name for name, _ in CASES}
    assert "dplab.reference.collectives.allreduce" in names
    assert "dplab.reference.train.sync.train_sync" in names
    assert "dplab.reference.train.buckets.Reducer.mark_param_as_ready" in names
    assert len(CASES) > 100


@pytest.mark.parametrize("name,fn", CASES, ids=[name for name, _ in CASES])
def test_public_function_documents_its_contract(name: str, fn: object) -> None:
    missing = missing_sections(fn)
    assert not missing, f"{name}: its docstring lacks {', '.join(missing)} (torch's Google style)"


@pytest.mark.parametrize("name,cls", CLASSES, ids=[name for name, _ in CLASSES])
def test_public_class_documents_its_constructor(name: str, cls: type) -> None:
    missing = class_missing(cls)
    assert not missing, f"{name}: its docstring lacks {', '.join(missing)} (torch's Google style)"


def test_the_checker_catches_what_it_should() -> None:
    def bare(x: int) -> int:
        """Double it."""
        return 2 * x

    def documented(x: int) -> int:
        """Double it.

        Args:
            x: a number.

        Returns:
            Twice ``x``.
        """
        return 2 * x

    def nothing() -> None:
        """Do nothing."""

    class Bare:
        """A thing."""

        def __init__(self, x: int) -> None:
            self.x = x

    assert class_missing(Bare) == ["Args"]
    assert missing_sections(bare) == ["Args", "Returns"]
    assert missing_sections(documented) == []
    assert missing_sections(nothing) == []
