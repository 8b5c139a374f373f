"""The shape of l3/ (docs_internal/l3_store.md, "Module map"): short modules, and none reaching into
another's private names, so each part can change (or be replaced, as the read path will be) on its own."""

import ast
import glob
import os

import pytest

L3 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "python", "sglang_cp", "l3")
MODULES = sorted(glob.glob(os.path.join(L3, "*.py")))
MAX_LINES = 500
# NamedTuple's public API carries a leading underscore (so as not to clash with field names).
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}


@pytest.mark.parametrize("path", MODULES, ids=os.path.basename)
def test_no_l3_module_is_long(path):
    with open(path) as f:
        n = sum(1 for _ in f)
    assert n <= MAX_LINES, f"{os.path.basename(path)}: {n} lines; split it along a seam"


@pytest.mark.parametrize("path", MODULES, ids=os.path.basename)
def test_no_l3_module_reaches_into_private_names(path):
    """`x._name` only on self/cls; `from m import _name` never (a private name is its module's own)."""
    tree = ast.parse(open(path).read())
    reach = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) and node.attr not in NAMEDTUPLE_API:
                reach.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            reach += [f"line {node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not reach, f"{os.path.basename(path)} uses private names of other objects or modules:\n" + "\n".join(reach)
