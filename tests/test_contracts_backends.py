"""Every export of ``dplab.backends`` states its contract as torch does: ``Args:``, ``Returns:``,
``Raises:`` (Google style, as in ``torch.nn.parallel.DistributedDataParallel``).

The modules covered are the ones a user imports (the READMEs, nn/README.md, the lessons): the short
import, the fast collectives, runs, the benchmark, launching, the torch wrappers, and the cluster of
namespaces and ZeRO's memory table that lessons 12 and 10 show. For each name in their ``__all__``,
a function (and each public method of a class) needs ``Args:`` when it takes parameters,
``Returns:`` (or ``Yields:``) when it returns a value, and ``Raises:`` when its own body raises; a
class documents its constructor's parameters under ``Args:`` (or ``Attributes:`` for a dataclass).
What the check reads is the code itself (``inspect`` and ``ast``), not a list kept here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap

import pytest

MODULES = ["dplab.backends", "dplab.backends.fastpath", "dplab.backends.runs",
           "dplab.backends.runs.run", "dplab.backends.runs.grid", "dplab.backends.runs.uploads",
           "dplab.backends.bench", "dplab.backends.launch.world", "dplab.backends.launch.interrupt",
           "dplab.backends.nn.ddp", "dplab.backends.nn.zero", "dplab.backends.nn.fsdp",
           "dplab.backends.torchdist.comm", "dplab.backends.hosts.netns",
           "dplab.backends.cli.memory"]
NEEDS_TORCH = {"dplab.backends.nn.ddp", "dplab.backends.nn.zero", "dplab.backends.nn.fsdp",
               "dplab.backends.torchdist.comm"}


def _body_does(fn, kinds) -> bool:
    """Whether fn's own body (not a nested def or class) has a node of one of these kinds."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return False
    tree = ast.parse(source).body[0]
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Return) and node.value is not None:
            if "return" in kinds and not (isinstance(node.value, ast.Constant)
                                          and node.value.value is None):
                return True
        if isinstance(node, (ast.Yield, ast.YieldFrom)) and "yield" in kinds:
            return True
        if isinstance(node, ast.Raise) and node.exc is not None and "raise" in kinds:
            return True
        todo.extend(ast.iter_child_nodes(node))
    return False


def _params(fn) -> list[str]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [name for name in signature.parameters if name not in ("self", "cls")]


def _gaps(fn, doc: str) -> list[str]:
    """The sections fn's docstring lacks."""
    gaps = []
    if _params(fn) and "Args:" not in doc:
        gaps.append("Args")
    if _body_does(fn, {"return", "yield"}) and "Returns:" not in doc and "Yields:" not in doc:
        gaps.append("Returns")
    if _body_does(fn, {"raise"}) and "Raises:" not in doc:
        gaps.append("Raises")
    return gaps


def _contracts(module_name: str):
    """(name, object, the sections its docstring lacks) for every callable the module exports."""
    module = importlib.import_module(module_name)
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isfunction(obj):
            yield name, obj, _gaps(obj, inspect.getdoc(obj) or "")
        elif inspect.isclass(obj):
            doc = inspect.getdoc(obj) or ""
            init = obj.__dict__.get("__init__")
            if dataclasses.is_dataclass(obj):
                fields = "Args:" in doc or "Attributes:" in doc
                yield name, obj, [] if fields or not dataclasses.fields(obj) else ["Args"]
            elif init is not None and inspect.isfunction(init):
                init_doc = doc + (inspect.getdoc(init) or "")
                yield name, obj, _gaps(init, init_doc)
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member):
                    yield f"{name}.{attr}", member, _gaps(member, inspect.getdoc(member) or "")


@pytest.mark.parametrize("module_name", MODULES)
def test_every_export_states_its_contract(module_name):
    if module_name in NEEDS_TORCH:
        pytest.importorskip("torch", reason="the torch wrappers need torch")
    missing = [f"{module_name}.{name}: {', '.join(gaps)}"
               for name, _, gaps in _contracts(module_name) if gaps]
    assert not missing, "docstrings lacking sections:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_section():
    def documented(x: int) -> int:
        """Twice x.

        Args:
            x: a number.

        Returns:
            2 x.

        Raises:
            ValueError: x is negative.
        """
        if x < 0:
            raise ValueError("x < 0")
        return 2 * x

    def bare(x: int) -> int:
        """Twice x."""
        if x < 0:
            raise ValueError("x < 0")
        return 2 * x

    assert _gaps(documented, inspect.getdoc(documented)) == []
    assert _gaps(bare, inspect.getdoc(bare)) == ["Args", "Returns", "Raises"]
