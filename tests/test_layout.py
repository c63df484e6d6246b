"""The package's architecture holds: no import cycle between its modules (imports inside
functions included), no import up a floor, and no source file over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "src" / "streamnmt"


def _module_name(path: Path, pkg: Path = PKG) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    """module -> the streamnmt modules it imports (at the top or inside a function)."""
    files = {_module_name(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                # `from pkg import module` runs pkg's __init__ first, but uses the module alone
                names = subs if all(s in files for s in subs) else [node.module, *subs]
            for name in names:
                if name in files and name != mod and name != "streamnmt":
                    graph[mod].add(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


# The package's rooms (a folder or a top-level module) by floor, from the top: each imports only
# from its own floor or the floors below it.
FLOORS = (
    ("__main__", "cli", "bench"),            # commands and the benchmark
    ("training",),                           # the loop and its parts
    ("inference",),                          # search, translate, scoring, export, average
    ("checkpoint", "config"),                # the file format, the job's dataclasses
    ("data", "engine"),
    ("dist", "configbase", "configfile"),    # process group; dataclass-to-flags machinery, YAML files
    ("models",),
    ("syncstats", "errors", "fsutil", "devices", "lazyinit", "setupclock", "testhooks", "streamnmt"),  # the ground
)


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def floor_of(module: str) -> int:
    for i, rooms in enumerate(FLOORS):
        if room(module) in rooms:
            return i
    raise AssertionError(f"{module}: its room {room(module)!r} stands on no floor of FLOORS; place it")


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {n}" for m, ns in graph.items() for n in ns if floor_of(n) < floor_of(m))


def test_imports_run_only_downward():
    up = arrows_up(import_graph())
    assert not up, "imports up a floor: " + "; ".join(up)


def test_the_floor_check_finds_an_import_up():
    graph = {"streamnmt.dist": {"streamnmt.engine.base"}, "streamnmt.engine.base": {"streamnmt.dist"}}
    assert arrows_up(graph) == ["streamnmt.dist -> streamnmt.engine.base"]


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_no_source_file_over_500_lines(path):
    assert len(path.read_text().splitlines()) <= 500, f"{path.relative_to(PKG)}: split it"


# -- size: classes and the training package's functions --------------------------------------------
MAX_METHODS = 20  # per class: its own and every one it inherits from a class of the package
MAX_FUNCTION_LINES = 60  # per function in training/, its docstring and comments included
# What truly cannot be split, with the reason; empty while everything fits.
METHOD_ALLOWANCE: dict[str, str] = {}
LINES_ALLOWANCE: dict[str, str] = {}


def class_methods(root: Path = PKG) -> dict[str, set[str]]:
    """module.Class -> the names of its methods, those of its bases in the package included (a mixin's
    methods are the class's own)."""
    own: dict[str, tuple[set[str], list[str]]] = {}
    by_name: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                key = f"{_module_name(path, root)}.{node.name}"
                names = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
                own[key] = (names, [ast.unparse(b).split(".")[-1] for b in node.bases])
                by_name.setdefault(node.name, []).append(key)

    def all_of(key: str, seen: frozenset[str] = frozenset()) -> set[str]:
        names, bases = own[key]
        out = set(names)
        for base in bases:
            for k in by_name.get(base, []):
                if k not in seen:
                    out |= all_of(k, seen | {key})
        return out

    return {key: all_of(key) for key in own}


def long_functions(root: Path = PKG / "training", limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """module.function (methods and nested functions too) -> its lines, where over ``limit``."""
    pkg = next(p for p in [root, *root.parents] if p.name == "streamnmt")
    out: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out[f"{_module_name(path, pkg)}.{node.name}"] = lines
    return out


def test_no_class_has_more_than_20_methods():
    big = {k: len(v) for k, v in class_methods().items() if len(v) > MAX_METHODS and k not in METHOD_ALLOWANCE}
    assert not big, f"classes over {MAX_METHODS} methods (own and inherited from the package): {big}; split them"


def test_no_function_in_training_over_60_lines():
    long = {k: n for k, n in long_functions().items() if k not in LINES_ALLOWANCE}
    assert not long, f"functions in training/ over {MAX_FUNCTION_LINES} lines: {long}; split them"


def test_the_size_checks_count_mixins_and_long_functions(tmp_path):
    pkg = tmp_path / "streamnmt"
    (pkg / "training").mkdir(parents=True)
    mixin = "\n".join(f"    def m{i}(self): pass" for i in range(15))
    (pkg / "parts.py").write_text(f"class Mixin:\n{mixin}\n\nclass Host(Mixin):\n    def run(self): pass\n"
                                  f"    def m0(self): pass\n")
    body = "\n".join("    x = 1" for _ in range(61))
    (pkg / "training" / "loop.py").write_text(f"def short():\n    pass\n\ndef long():\n{body}\n")
    methods = class_methods(pkg)
    assert len(methods["streamnmt.parts.Host"]) == 16 and len(methods["streamnmt.parts.Mixin"]) == 15
    assert long_functions(pkg / "training") == {"streamnmt.training.loop.long": 62}
