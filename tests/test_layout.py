"""The repository's layout: no import cycle between the project's files (every import, also the
ones inside functions, read with ast), and the top level kept to the models and the training spine."""
import ast
import glob
import os
import re
import subprocess

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


# ----------------------------------------------------------------------------- torch's configuration in tests


def dotted(node):
    """The dotted name of an attribute chain (torch._dynamo.config), or None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def torch_config_writes(source):
    """The line numbers where source sets or deletes an attribute of a torch config module
    (torch._dynamo.config, torch._inductor.config, ...) other than through its own patch():
    monkeypatch.setattr / delattr, setattr / delattr, or an assignment."""
    is_config = lambda name: bool(name) and name.startswith("torch.") and name.split(".")[-1] == "config"
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("setattr", "delattr") and is_config(dotted(node.args[0])):
                hits.append(node.lineno)
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        hits += [node.lineno for t in targets if isinstance(t, ast.Attribute) and is_config(dotted(t.value))]
    return sorted(hits)


def test_config_write_finder_sees_each_spelling():
    source = ("import torch\n"
              "def test_a(monkeypatch):\n"
              "    monkeypatch.setattr(torch._dynamo.config, 'recompile_limit', 8)\n"
              "    setattr(torch._inductor.config, 'x', 1)\n"
              "    torch._dynamo.config.cache_size_limit = 4\n"
              "    monkeypatch.delattr(torch._dynamo.config, 'y')\n"
              "    with torch._dynamo.config.patch(recompile_limit=8):\n"
              "        monkeypatch.setattr(torch, 'compile', None)\n")
    assert torch_config_writes(source) == [3, 4, 5, 6]


def test_tests_change_torch_config_only_through_its_patch():
    """A monkeypatch of torch._dynamo.config is undone by pytest 9.2 as if the attribute had not
    existed: the option is hidden for every later test (AttributeError). torch's
    config.patch(...) restores it under every pytest."""
    paths = glob.glob(os.path.join(REPO, "tests", "*.py")) + glob.glob(os.path.join(REPO, "*.py"))
    assert os.path.join(REPO, "tests", "test_compile.py") in paths
    hits = [f"{os.path.relpath(p, REPO)}:{n}" for p in sorted(paths) if "test" in os.path.basename(p)
            for n in torch_config_writes(open(p, encoding="utf-8").read())]
    assert not hits, hits


# ----------------------------------------------------------------------------- the front door and history

HISTORY = re.compile(r"issue[ -][0-9]|this\s+round|previous\s+round", re.IGNORECASE)


def tracked_files():
    """The repository's git-tracked files (paths relative to REPO)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def is_document(path):
    """A .py or .md file someone reads: everything but the raw files under results/ (the tools'
    markdown outputs beside a result's README.md)."""
    if not path.endswith((".py", ".md")):
        return False
    return not (path.startswith("results/") and path.endswith(".md") and os.path.basename(path) != "README.md")


def history_lines(paths):
    """[(path, line number, line)] of the documents' lines that cite tracker issues or rounds."""
    hits = []
    for path in paths:
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            hits += [(path, n, line.strip()) for n, line in enumerate(f, 1) if HISTORY.search(line)]
    return hits


def test_history_finder_sees_issue_numbers_and_rounds_and_skips_raw_results(tmp_path):
    issue, rnd = "issue", "round"  # split, so that this file's own source does not match
    assert HISTORY.search(f"see {issue} 12") and HISTORY.search(f"the {issue}-6 targets") and HISTORY.search(f"This {rnd}'s CPU")
    assert HISTORY.search(f"in the previous {rnd}") and not HISTORY.search("--rounds 3, the order reversed every other round")
    assert is_document("train.py") and is_document("results/bench/README.md") and is_document("results/gpu_estimate.py")
    assert not is_document("results/bench/bench_cpu_window_i.md") and not is_document("results/reflux/sweep.json")


def test_no_issue_numbers_or_rounds_in_code_or_documents():
    docs = [p for p in tracked_files() if p.endswith((".py", ".md"))]  # the tools' raw markdown outputs too
    assert "README.md" in docs and "tango.py" in docs and "results/bench/bench_cpu_window_i.md" in docs
    hits = history_lines(docs)
    assert not hits, "\n".join(f"{p}:{n}: {line}" for p, n, line in hits)


def test_readme_and_results_index_are_short():
    for path, most in (("README.md", 150), ("results/README.md", 200)):
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            n = len(f.read().splitlines())
        assert 0 < n <= most, f"{path}: {n} lines, at most {most}"


def test_readme_keeps_the_commands_ci_runs_and_the_places_the_lead_fills():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    commands = readme[readme.index("```\n") + 4:]
    commands = commands[:commands.index("```")]
    # what a user types: no path outside the repository (the tests find the vocabulary file themselves)
    assert commands == ("pip install torch==2.13.0 -r requirements.txt && python train.py --model tango --depth 8\n"
                        "pip install -r requirements-dev.txt && python -m pytest -q\n")
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:  # CI installs both files, runs the same test line
        ci = f.read()
    assert "-r requirements.txt -r requirements-dev.txt" in ci and "\npython -m pytest -q\n" in ci
    for marker in ("<!-- main job output -->", "<!-- headline -->"):
        assert readme.count(marker) == 1, marker


def test_docs_training_flag_table_is_the_parsers_declarations():
    """README: "Every flag: python train.py --help and docs/training.md"; the doc's flag tables are
    tools.flag_table's output over train.py's parser (the declarations it is built from), byte for byte,
    so a new flag is documented by its declaration's help text."""
    from tools import flag_table
    with open(os.path.join(REPO, "docs", "training.md"), encoding="utf-8") as f:
        doc = f.read()
    begin, end = flag_table.MARKERS
    block = doc[doc.index(begin) + len(begin):doc.index(end)]
    assert block == flag_table.flag_tables(), "docs/training.md's flag tables are stale: python -m tools.flag_table " \
                                              "--into docs/training.md"
    assert "`--[no-]jacobi_random`" in block and "| `--learning_rate` | peak learning rate; default: tiny" in block


def test_docs_flag_tables_do_not_depend_on_the_machine(monkeypatch):
    """A default that is this machine's (--num_proc: its CPU count) is said in words, so the tables
    are the same on 2 cores and on a 16-core GPU machine."""
    from tools import flag_table
    here = flag_table.flag_tables()
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert flag_table.flag_tables() == here

def markdown_links(path):
    """The relative link targets [text](target) of a markdown file."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        text = f.read()
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def heading_anchors(path):
    """GitHub's anchors of a markdown file's headings: lower case, punctuation but - dropped, spaces to -."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        heads = re.findall(r"^#+ (.*)$", f.read(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_relative_link_of_the_documents_resolves():
    docs = [p for p in tracked_files() if p.endswith(".md") and is_document(p)]
    assert "docs/training.md" in docs and "results/chargrid/README.md" in docs
    bad = []
    for doc in docs:
        for link in markdown_links(doc):
            path, _, anchor = link.partition("#")
            target = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(os.path.join(REPO, target)):
                bad.append(f"{doc}: {link} (no such file)")
            elif anchor and target.endswith(".md") and anchor not in heading_anchors(target):
                bad.append(f"{doc}: {link} (no such heading)")
    assert not bad, "\n".join(bad)


def test_heading_anchors_follow_github():
    assert markdown_links("README.md") and "cost-flopspy" in heading_anchors("MATH.md")


def test_every_result_folder_has_a_readme_listed_in_the_index():
    with open(os.path.join(REPO, "results", "README.md"), encoding="utf-8") as f:
        index = f.read()
    folders = sorted(p.split("/")[1] for p in tracked_files() if p.startswith("results/") and p.count("/") >= 2)
    assert "chargrid" in folders and "bench" in folders
    for name in set(folders):
        assert os.path.exists(os.path.join(REPO, "results", name, "README.md")), name
        assert f"]({name}/README.md" in index, f"results/README.md does not list {name}/"


def test_no_list_of_model_names_outside_the_registry():
    """One fact, one place: what a model is lives in its file or its registry row (models.ModelSpec),
    so no code keeps a list, tuple, set or dict naming two or more registered models, except
    models.py (the registry) and a model file naming its own models. Tests choose models through
    the registry (tests/checks.py: readers, first_readers, GRID_MODELS): a test may name the models
    of one model file together, never models of two files (a new model, in its own file, then joins
    no list by hand), except the hand computations (tests/test_equations.py), one per model."""
    import ast
    import models
    home = {name: spec.build.__module__ for name, spec in models.REGISTRY.items()}
    found = []
    for path in tracked_files():
        if not path.endswith(".py") or path.startswith("results/") or path in ("models.py", "tests/test_equations.py"):
            continue
        test = path.startswith("tests/") or path in ("conftest.py", "test_all.py")
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                named = [e.value for e in items if isinstance(e, ast.Constant) and e.value in home]
                files = {home[n] + ".py" for n in named}
                if len(named) >= 2 and (len(files) > 1 if test else files != {path}):
                    found.append(f"{path}:{node.lineno} {named}")
    assert found == []
