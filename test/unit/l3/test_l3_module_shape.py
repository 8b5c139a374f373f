"""The shape of l3/ (docs_internal/l3_store.md, "Module map"; docs_internal/package_boundary.md): short
modules, none reaching into another's private names, so each part can change (or be replaced, as the read
path will be) on its own; and its subpackages layered: the on-disk format (l3/format/) under everything,
the offline tools (l3/tools/) over it and never under the store."""

import ast
import glob
import os

import pytest

L3 = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "python",
                                   "sglang_cp", "l3"))
MODULES = sorted(glob.glob(os.path.join(L3, "**", "*.py"), recursive=True))
MAX_LINES = 500
# NamedTuple's public API carries a leading underscore (so as not to clash with field names).
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: os.path.relpath(p, L3))
def test_no_l3_module_is_long(path):
    with open(path) as f:
        n = sum(1 for _ in f)
    assert n <= MAX_LINES, f"{os.path.basename(path)}: {n} lines; split it along a seam"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: os.path.relpath(p, L3))
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


def _name(path: str) -> str:
    rel = os.path.relpath(path, L3)[:-3].replace(os.sep, ".")
    return "sglang_cp.l3" + ("" if rel == "__init__" else "." + rel.removesuffix(".__init__"))


def _l3_imports(path: str) -> set[str]:
    """Every sglang_cp.l3 module or package `path` imports (module level, in functions, relative or not)."""
    me = _name(path)
    pkg = me if path.endswith("__init__.py") else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = pkg.rsplit(".", node.level - 1)[0] if node.level else ""
            src = ".".join(x for x in (base, node.module) if x)
            out |= {f"{src}.{a.name}" for a in node.names} | {src}
    return {m for m in out if m == "sglang_cp.l3" or m.startswith("sglang_cp.l3.")}


def _in(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


FORMAT, TOOLS = "sglang_cp.l3.format", "sglang_cp.l3.tools"
ERRORS = "sglang_cp.l3.errors"


@pytest.mark.parametrize("path", [p for p in MODULES if _in(_name(p), FORMAT)], ids=lambda p: os.path.relpath(p, L3))
def test_the_on_disk_format_imports_only_itself_and_the_errors(path):
    """l3/format/ is what outlives a store (the files and how to read them): the offline tools and any
    other reader use it without a running store, so it may not import the store's runtime parts."""
    # `from .. import errors` names sglang_cp.l3 too (the package it is taken from): only errors counts.
    bad = {m for m in _l3_imports(path) if not (_in(m, FORMAT) or _in(m, ERRORS) or m == "sglang_cp.l3")}
    assert not bad, f"{_name(path)} imports {sorted(bad)}; the on-disk format may import only l3.format and l3.errors"


@pytest.mark.parametrize("path", [p for p in MODULES if not _in(_name(p), TOOLS)], ids=lambda p: os.path.relpath(p, L3))
def test_nothing_in_the_store_imports_the_offline_tools(path):
    bad = {m for m in _l3_imports(path) if _in(m, TOOLS)}
    assert not bad, f"{_name(path)} imports {sorted(bad)}; l3/tools/ is the operator's, the store never needs it"


def test_the_layering_checks_see_imports():
    """The two checks above must be able to fail: on this tree they find the imports they would forbid
    elsewhere (the tools import the config, a runtime module; the store imports the format)."""
    tools = [p for p in MODULES if _name(p) == TOOLS + ".fsck"]
    assert tools and "sglang_cp.l3.config" in _l3_imports(tools[0])
    opening = [p for p in MODULES if _name(p) == "sglang_cp.l3.opening"]
    assert opening and "sglang_cp.l3.format.index" in _l3_imports(opening[0])
    occupancy = [p for p in MODULES if _name(p) == TOOLS + ".occupancy"]
    assert occupancy and TOOLS + ".fsck" in _l3_imports(occupancy[0])
