"""What the reference engine's words promise is what the tests show, and learners meet the words.

Equality has three meanings here: replicas of a synchronous run are BITWISE identical to
each other, a resumed run is bitwise identical to an uninterrupted one, and against one
device a data-parallel run agrees to ROUNDING (float64: 1e-10 relative; measured ~1e-16).
No docstring or comment may claim bitwise equality with single-device training, because
it is false, as measured below. And the packages where learners meet SSP, clock,
staleness, delay and two-shot define them.
"""

from __future__ import annotations

import ast
import re
import tokenize
from pathlib import Path

import numpy as np
import pytest

from dplab.backends.launch.world import launch
from dplab.reference import ps, train
from dplab.reference.ps.trainer import AsyncConfig, train_async
from dplab.reference.train.single import TrainConfig, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

ROOT = Path(train.__file__).resolve().parents[1]  # reference/
SUBJECT = re.compile(r"single[- ]device|train_single|synchronous data parallelism|train_sync", re.I)
EXACT = re.compile(r"bit for bit|bitwise|exactly|the same bits", re.I)
HEDGED = re.compile(r"rounding|1e-\d|not to the bit|uninterrupted", re.I)


def prose(path: Path) -> list[str]:
    """Docstrings and comments, without their code examples, as paragraphs."""
    tree = ast.parse(path.read_text())
    docs = [ast.get_docstring(n) or "" for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)]
    with path.open() as f:
        comments = [t.string.lstrip("# ") for t in tokenize.generate_tokens(f.readline)
                    if t.type == tokenize.COMMENT]
    paragraphs = [p for d in docs for p in re.split(r"\n\s*\n", d)]
    return [" ".join(line for line in p.splitlines() if not line.startswith("    "))
            for p in paragraphs] + comments


def overclaims(path: Path) -> list[str]:
    found = [s for p in prose(path) for s in re.split(r"(?<=[.;])\s+", p)]
    return [s for s in found if SUBJECT.search(s) and EXACT.search(s) and not HEDGED.search(s)]


def test_the_claim_checker_catches_the_old_sentence() -> None:
    old = ("synchronous training with a straggler still equals single-device training bit for bit, "
           "and an asynchronous run still replays exactly from its log.")
    assert SUBJECT.search(old) and EXACT.search(old) and not HEDGED.search(old)


@pytest.mark.parametrize(
    "path", sorted(ROOT.glob("**/*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_docstring_claims_bitwise_equality_with_one_device(path: Path) -> None:
    assert not overclaims(path), overclaims(path)


def test_what_the_words_say_is_what_is_measured() -> None:
    cfg = TrainConfig(steps=10)
    single = train_single(cfg).params
    ranks = launch(train_sync, 3, args=(cfg, SyncConfig("ring")))
    gap = float(np.max(np.abs(ranks[0].params - single)))
    assert 0 < gap <= 1e-10 * max(1.0, float(np.max(np.abs(single))))  # rounding, not bits
    assert all(np.array_equal(r.params, ranks[0].params) for r in ranks)  # replicas: bits
    server = launch(train_async, 4, args=(cfg, AsyncConfig(0, aggregate=True)))[0]
    gap = float(np.max(np.abs(server.params - single)))
    assert gap <= 1e-10 * max(1.0, float(np.max(np.abs(single))))


TERMS = {"SSP", "clock", "staleness", "delay", "two-shot"}


@pytest.mark.parametrize("package", [ps, train], ids=["ps", "train"])
def test_the_glossary_defines_each_word_where_learners_meet_it(package) -> None:
    doc = package.__doc__ or ""
    assert "Glossary" in doc
    glossary = doc.split("Glossary", 1)[1]
    defined = {m.group(1) for m in re.finditer(r"^\s{4}(\S+)\s{2,}", glossary, re.M)}
    assert TERMS <= defined, f"not defined: {TERMS - defined}"
    assert re.search(r"staleness\s+(s, )?in CLOCKS", glossary) and re.search(
        r"delay\s+in UPDATES", glossary
    )
