"""The repository's layout: no import cycle between the project's files (every import, also the
ones inside functions, read with ast), and the top level kept to the models and the training spine."""
import ast
import glob
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("harness", "tools", "studies")


def project_files():
    """module name -> path of every project .py file (the tests and results scripts aside)."""
    out = {}
    for path in glob.glob(os.path.join(REPO, "*.py")):
        out[os.path.basename(path)[:-3]] = path
    for pkg in PACKAGES:
        for path in glob.glob(os.path.join(REPO, pkg, "*.py")):
            name = os.path.basename(path)[:-3]
            out[pkg if name == "__init__" else f"{pkg}.{name}"] = path
    return out


def imports_of(path, modules):
    """The project modules that the file at path imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in modules:
                found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
    return found


def find_cycle(graph):
    """One import cycle of graph (module -> set of modules) as a list, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                cycle = visit(n)
                if cycle:
                    return cycle
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_a_planted_cycle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_project_files():
    files = project_files()
    graph = {m: imports_of(p, files) - {m} for m, p in files.items()}
    assert len(files) > 30 and graph["train"] >= {"data", "models"}  # the walk sees the real imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_top_level_holds_at_most_18_python_files():
    top = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "*.py")))
    assert len(top) <= 18, top
    for brief in ("tango.py", "parcae.py", "latent_tokens.py", "baselines.py", "train.py", "data.py", "flops.py",
                  "test_all.py"):
        assert brief in top
