"""The import graph of the minfer package has no cycle: imports flow one way (apps -> generate / checkpoint /
sparsity -> model -> formats / attention -> ops). Every import statement counts, at module level and inside
functions, so a cycle held together by function-level imports fails too."""

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "minfer"


def module_files(root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module and package of the tree at `root`."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name an import statement in the file names, relative ones resolved against its package
    (`from . import x` gives both the package and package.x: x may be a module or an attribute)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of the tree its imports run. Importing a.b.c from outside package a.b also
    runs a.b's __init__ (and a's); from inside, that package is already being imported."""
    graph = {}
    for module, path in modules.items():
        edges = set()
        for name in imported_names(module, path):
            parts = name.split(".")
            for end in range(len(parts), 0, -1):
                target = ".".join(parts[:end])
                if target in modules and target != module and not module.startswith(target + "."):
                    edges.add(target)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for successor in sorted(graph[node]):
            if state.get(successor) == "open":
                return stack[stack.index(successor):] + [successor]
            if successor not in state:
                cycle = visit(successor)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_package_imports_have_no_cycle():
    graph = import_graph(module_files())
    assert {"minfer.model", "minfer.formats", "minfer.formats.base", "minfer.checkpoint"} <= set(graph)
    assert "minfer.formats.base" in graph["minfer.model"] or "minfer.formats" in graph["minfer.model"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    package = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def f():\n    from .sub.c import g\n",
        "pkg/sub/__init__.py": "from .c import g\n",
        "pkg/sub/c.py": "def g():\n    import pkg.a\n",
    })
    cycle = find_cycle(import_graph(module_files(package)))
    assert cycle is not None and cycle[0] == cycle[-1]
    assert {"pkg.a", "pkg.b", "pkg.sub.c"} <= set(cycle)


def test_a_package_importing_its_own_modules_is_no_cycle(tmp_path):
    """formats/__init__ imports formats.base, which imports nothing above it: no cycle. Importing a module of
    another package runs that package's __init__ too; importing a sibling does not run one's own again."""
    package = write_package(tmp_path, {
        "pkg/__init__.py": "from .sub.base import X\nfrom .sub import dense\n",
        "pkg/sub/__init__.py": "from .base import X\nfrom .dense import Y\n",
        "pkg/sub/base.py": "X = 1\n",
        "pkg/sub/dense.py": "from .base import X\nfrom . import base\nY = X\n",
        "pkg/user.py": "import pkg.sub.dense\n",
    })
    graph = import_graph(module_files(package))
    assert graph["pkg.user"] == {"pkg.sub", "pkg.sub.dense"}
    assert graph["pkg.sub.dense"] == {"pkg.sub.base"}
    assert graph["pkg"] == {"pkg.sub", "pkg.sub.base", "pkg.sub.dense"}
    assert find_cycle(graph) is None
