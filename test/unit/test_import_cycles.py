"""No import cycles inside sglang_cp, counting every import: module level, inside functions, and
``if TYPE_CHECKING`` blocks alike (a lazy or type-only import back is still a circle in the design).

A circle can also hide without any import: a module takes the object of a module that imports it as
a parameter typed ``Any`` (or not typed at all) and reaches into its attributes, or names its class
in a string annotation. Both count as an edge here: the attributes used on such a reference are
matched against the classes of the package, and a class they all belong to is the module the
reference really points to (``writer.WriteThread(store: Any)`` using ``store._lock``, ``store._q``,
... is an edge writer -> store, however it is spelled)."""

import ast
import os

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python", "sglang_cp")
# Inferred (not imported) edges this test found outside the L3 store and that are not fixed yet. Each
# entry is a circle to remove, not a pattern to copy: the list may only shrink.
KNOWN_OPAQUE = {
    # register_mapping(mapping) works on a SlabMapping's `registered` / `plan`, and slab_mapping imports
    # it back in close(); its callers and tests are on the GPU path.
    ("sglang_cp.l2.registration", "sglang_cp.l2.slab_mapping"),
}


def _modules(pkg: str = PKG) -> dict[str, str]:
    mods = {}
    for dirpath, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(pkg))[:-3].replace(os.sep, ".")
                mods[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return mods


def _imports(mod: str, tree: ast.AST, is_pkg: bool, mods: dict) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
        out.update(t for t in targets if t in mods and t != mod)
    return out


# -- references that carry no import ----------------------------------------------------------------

def _class_attrs(tree: ast.AST) -> dict[str, set[str]]:
    """Per top-level class: its methods, class-level names and every `self.X` its methods assign."""
    out = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names = set()
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in cls.body:
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Name) and node in cls.body:
                            names.add(sub.id)
                        elif (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                              and sub.value.id == "self"):
                            names.add(sub.attr)
        out[cls.name] = names
    return out


def _untyped(arg: ast.arg) -> bool:
    a = arg.annotation
    return (a is None or (isinstance(a, ast.Name) and a.id == "Any")
            or (isinstance(a, ast.Attribute) and a.attr == "Any")
            or (isinstance(a, ast.Constant) and a.value == "Any"))


def _opaque_references(tree: ast.AST) -> list[tuple[str, set[str]]]:
    """(where, attributes used) for each parameter typed Any or not typed, following it through
    `self.X = param` into the class's other methods and through local aliases (`s = self.X`)."""
    refs = []
    scopes = [(None, f) for f in tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        scopes += [(cls, f) for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for cls, fn in scopes:
        params = [a for a in fn.args.args + fn.args.kwonlyargs if a.arg not in ("self", "cls") and _untyped(a)]
        for p in params:
            held = set()  # self.X bound to the parameter
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id == p.arg:
                    held |= {t.attr for t in node.targets if isinstance(t, ast.Attribute)
                             and isinstance(t.value, ast.Name) and t.value.id == "self"}
            bodies = [fn] if cls is None or not held else [f for c, f in scopes if c is cls]
            used = set()
            for body in bodies:
                names = {p.arg} if body is fn else set()
                for node in ast.walk(body):  # local aliases of self.X
                    if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute)
                            and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"
                            and node.value.attr in held):
                        names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                for node in ast.walk(body):
                    if not isinstance(node, ast.Attribute):
                        continue
                    v = node.value
                    if (isinstance(v, ast.Name) and v.id in names) or (
                            isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name)
                            and v.value.id == "self" and v.attr in held):
                        used.add(node.attr)
            used = {a for a in used if not a.startswith("__")}
            # One attribute says little (`.name`, `.close`); two private ones or three of any kind name a class.
            if sum(a.startswith("_") for a in used) >= 2 or len(used) >= 3:
                refs.append((f"{fn.name}({p.arg})", used))
    return refs


def _annotation_names(tree: ast.AST) -> set[str]:
    """Names used in annotations, string annotations included."""
    out = set()
    for node in ast.walk(tree):
        anns = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            args = a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]
            anns = [x.annotation for x in args if x] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            anns = [node.annotation]
        for ann in filter(None, anns):
            for sub in ast.walk(ann):
                if isinstance(sub, ast.Name):
                    out.add(sub.id)
                elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    try:
                        out |= {n.id for n in ast.walk(ast.parse(sub.value, mode="eval")) if isinstance(n, ast.Name)}
                    except SyntaxError:
                        pass
    return out


def _local_names(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
    return out


def _graph(pkg: str = PKG, why: dict | None = None, known=frozenset()) -> dict[str, set[str]]:
    mods = _modules(pkg)
    trees = {m: ast.parse(open(p).read()) for m, p in mods.items()}
    classes = {m: _class_attrs(t) for m, t in trees.items()}
    defined: dict[str, set[str]] = {}
    for m, cs in classes.items():
        for c in cs:
            defined.setdefault(c, set()).add(m)
    why = {} if why is None else why
    graph = {m: set() for m in mods}
    for mod, tree in trees.items():
        graph[mod] |= _imports(mod, tree, mods[mod].endswith("__init__.py"), mods)
        for where, used in _opaque_references(tree):
            for other, cs in classes.items():
                for cname, attrs in cs.items():
                    if other != mod and used <= attrs and (mod, other) not in known:
                        graph[mod].add(other)
                        why.setdefault((mod, other), f"{where} is used as a {other}.{cname}")
        local = _local_names(tree)
        for name in _annotation_names(tree) - local:
            owners = defined.get(name, set()) - {mod}
            if len(owners) == 1:
                other = owners.pop()
                graph[mod].add(other)
                why.setdefault((mod, other), f"annotation {name!r} names {other}.{name}")
    return graph


def _cycles(graph):
    out, state, stack = [], {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                out.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return out


def _describe(cycle, why) -> str:
    hops = []
    for a, b in zip(cycle, cycle[1:]):
        hops.append(f"{a} -> {b}" + (f"  ({why[(a, b)]})" if (a, b) in why else ""))
    return "\n  ".join(hops)


def test_no_import_cycles():
    # A package's __init__ importing its own submodules is not a circle; a submodule importing it back is.
    why: dict = {}
    graph = _graph(why=why, known=KNOWN_OPAQUE)
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join("  " + _describe(c, why) for c in cycles)


def test_an_opaque_back_reference_is_an_edge(tmp_path):
    """The detector itself: a module that takes its importer's object as `Any` and uses its private
    attributes closes a circle, as does a string annotation naming the importer's class."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "owner.py").write_text(
        "from .worker import Worker\n\n"
        "class Owner:\n"
        "    def __init__(self):\n"
        "        self._lock = None\n"
        "        self._queue = []\n"
        "        self.worker = Worker(self)\n\n"
        "    def _settle(self, msg):\n"
        "        pass\n")
    (pkg / "worker.py").write_text(
        "from typing import Any\n\n"
        "class Worker:\n"
        "    def __init__(self, owner: Any):\n"
        "        self.o = owner\n\n"
        "    def run(self):\n"
        "        s = self.o\n"
        "        with s._lock:\n"
        "            s._settle(s._queue.pop())\n")
    why: dict = {}
    graph = _graph(str(pkg), why)
    assert "pkg.owner" in graph["pkg.worker"], why
    assert _cycles(graph)
    (pkg / "worker.py").write_text(
        "class Worker:\n"
        "    def __init__(self, owner: 'Owner'):\n"
        "        self.o = owner\n")
    assert "pkg.owner" in _graph(str(pkg))["pkg.worker"]
