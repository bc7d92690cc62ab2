"""``dplab <cmd> --help`` explains every option and shows its default;
``--version`` is the installed one."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version

import pytest

from dplab.backends.cli.args import build_parser


def _subparsers():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.choices and hasattr(a, "_name_parser_map")]
    return sub.choices


def _option_blocks(text: str) -> dict[str, str]:
    """Each option's help block in ``--help`` output, keyed by its first option string."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (--[a-z][\w-]*)", line)
        if m:
            current = m.group(1)
            blocks[current] = line
        elif current and line.startswith("      "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return {k: re.sub(r"\s+", " ", v) for k, v in blocks.items()}


@pytest.mark.parametrize("command", ["train", "compare", "bench"])
def test_every_option_is_explained_with_its_default(command):
    sub = _subparsers()[command]
    blocks = _option_blocks(sub.format_help())
    options = [a.option_strings[0] for a in sub._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 10 and set(options) <= set(blocks), set(options) - set(blocks)
    for action in sub._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help and len(action.help) > 8, (
            f"{command} {action.option_strings[0]} has no help"
        )
        block = blocks[action.option_strings[0]]
        assert "default" in block, (
            f"{command} {action.option_strings[0]} does not show its default: {block}"
        )
    assert "default: None" not in sub.format_help() and "[32, 32]" not in sub.format_help()


def test_defaults_are_shown_as_typed():
    blocks = _option_blocks(_subparsers()["train"].format_help())
    assert "(default: 32,32)" in blocks["--hidden"]
    assert "(default: 0.01)" in blocks["--lr"]
    assert "default 4" in blocks["--world-size"]
    bench = _option_blocks(_subparsers()["bench"].format_help())
    assert "(default: 4K,1M,16M,64M)" in bench["--sizes"]
    assert "(default: ring,tree,naive,native)" in bench["--algorithms"]


def test_version_is_the_installed_distribution():
    proc = subprocess.run(
        [sys.executable, "-m", "dplab.backends.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"dplab {version('dplab')}"
