"""The layout keeps its promises: no import cycle among the project's modules, no module over 450
lines, training/ imports only itself (it is what ships to the nodes), node_setup/ only sets nodes up."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "cluster", "node_setup", "twin", "sweep", "launch", "doctor", "reports", "infra", "training")
TOP = ("fabfile", "__main__")
MAX_LINES = 450  # a guard against sprawl; it should not split one concept over modules (the store: 422)


def modules() -> dict[str, Path]:
    found = {name: ROOT / f"{name}.py" for name in TOP}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports anywhere in its text (function-level imports count)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a.b.c -> a.b -> a: the deepest project module named
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_the_import_walker_sees_a_cycle_when_there_is_one():
    g = graph()
    assert "launch.plan.request" in g["launch.run"]  # sees plain imports
    assert "cluster.aws" in g["cluster.inventory"]  # and function-level ones
    assert cycles({**g, "core.errors": {"cluster.inventory"}})  # a planted back edge is found


def test_no_import_cycle_among_the_project_modules():
    assert cycles(graph()) == []


def test_packages_depend_one_way():
    order = {"core": 0, "cluster": 1, "node_setup": 2, "twin": 2, "sweep": 2, "infra": 3, "launch": 3, "doctor": 4,
             "reports": 4, "fabfile": 5, "__main__": 5}
    for name, deps in graph().items():
        pkg = name.split(".")[0]
        if pkg == "training":
            continue
        for dep in deps:
            target = dep.split(".")[0]
            if target not in (pkg, "training"):
                assert order[target] < order[pkg], f"{name} imports {dep}"


def contract_names(path: Path) -> set[str]:
    """The names a module imports from training, relative to training.runtime: 'store', 'paths.RunPaths'; a name
    from elsewhere in training keeps its whole path ('training.jobs.dist')."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "training":
            base = node.module.removeprefix("training.runtime").lstrip(".")
            used |= {f"{base}.{a.name}".lstrip(".") if base or node.module == "training.runtime" else
                     f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            used |= {a.name for a in node.names if a.name.split(".")[0] == "training"}
    return used


def test_the_operator_side_imports_only_the_contract():
    """training/runtime is the contract between launch and the ranks, and only its CONTRACT names cross: a change to a
    job, or to the runtime's insides, cannot break fab."""
    from training.runtime import CONTRACT

    assert len(CONTRACT) <= 12, CONTRACT
    used = {name: contract_names(path) for name, path in modules().items() if not name.startswith("training")}
    outside = {name: sorted(names - set(CONTRACT)) for name, names in used.items() if names - set(CONTRACT)}
    assert outside == {}, outside
    assert set().union(*used.values()) == set(CONTRACT)  # each name is used: the list says what crosses, no more


def test_the_contract_check_sees_a_name_from_outside_it(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from training.runtime import store\nfrom training.runtime.paths import RunPaths, node_run_of\n"
                     "from training.jobs import dist\nimport training.speed.mfu\n")
    assert contract_names(probe) == {"store", "paths.RunPaths", "paths.node_run_of", "training.jobs.dist",
                                     "training.speed.mfu"}


def _room(name: str, top: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == top and len(parts) > 2 else None


def test_the_rooms_of_training_depend_one_way():
    """jobs -> speed -> runtime; the rank hook imports none of them by name (it loads ours by path)."""
    order = {"runtime": 0, "speed": 1, "jobs": 2}
    for name, deps in graph().items():
        room = _room(name, "training")
        if name.startswith("training.hook"):
            assert not {d for d in deps if d.startswith("training")}, (name, deps)
        if room not in order:
            continue
        for dep in deps:
            target = _room(dep, "training")
            assert target is None or order[target] <= order[room], f"{name} imports {dep}"


def test_the_rooms_of_launch_depend_one_way():
    """staging (out and back) <- plan (flags to mpirun) <- life (a run's record and ending) <- run (one run) <-
    supervision (flags resolved, restarts, the supervisor): no two-way imports, function-level ones included."""
    order = {"staging": 0, "plan": 1, "life": 2, "run": 3, "supervision": 4}
    rooms = {}
    for name in graph():
        parts = name.split(".")
        if parts[0] == "launch" and len(parts) > 1:
            rooms[name] = parts[1]
    assert set(rooms.values()) == set(order), set(rooms.values())
    for name, deps in graph().items():
        for dep in deps:
            if name in rooms and dep in rooms:
                assert order[rooms[dep]] <= order[rooms[name]], f"{name} imports {dep}: launch's rooms go one way"


def test_training_imports_only_itself_because_only_it_ships_to_the_nodes():
    for name, deps in graph().items():
        if name.startswith("training"):
            assert all(d.startswith("training") for d in deps), (name, deps)


def test_no_module_over_the_line_cap():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_node_setup_holds_only_node_set_up():
    assert {p.name for p in (ROOT / "node_setup").iterdir() if p.suffix in (".py", ".toml")} == {
        "__init__.py", "profiles.py", "profiles.toml", "setup.py",
        "publish_host_keys.py", "head_boot.py"}  # the last two: at an instance's boot, before any project code


def _code_lines() -> list[tuple[str, int, str]]:
    """(module, line number, line) of every project module and template outside tests/ and bench/."""
    out = []
    files = [(name, path) for name, path in modules().items()]
    files += [(f"templates/{p.name}", p) for p in sorted((ROOT / "templates").glob("*.j2"))]
    for name, path in files:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.lstrip().startswith("#"):
                out.append((name, i, line))
    return out


def test_one_module_writes_run_records():
    """Only launch/life/records.py moves or saves a record (its named transitions also publish to the store)."""
    writers = {m for m, _, line in _code_lines() if "._move(" in line or "._save(" in line}
    assert writers <= {"launch.life.records"}, writers


def test_a_runs_places_are_built_in_one_place():
    """'<home>/runs/<id>', 'runs/{id}/...' and checkpoint folder names come from training/runtime/paths.py (RunPaths)."""
    import re

    builds = re.compile(r"""f["'][^"']*(/runs/\{|runs/\{|step-\{|checkpoint-\{)""")
    places = {m for m, _, line in _code_lines() if builds.search(line)}
    assert places == set(), places  # training/runtime/paths.py builds them from RUNS and _CHECKPOINT


def test_one_owner_reads_a_checkpoints_step():
    """Checkpoints (training/runtime/paths.py) alone parses a checkpoint folder's name; every caller asks it."""
    parsers = [(name, line, text) for name, path in modules().items() if name != "training.runtime.paths"
               for line, text in _strings(path) if "checkpoint-(" in text or "step-(" in text or text == r"(\d+)$"]
    assert parsers == [], parsers


def test_the_store_url_is_looked_up_in_at_most_four_lines():
    import re

    lookups = [(m, i) for m, i, line in _code_lines()
               if re.search(r"""(\.get\(|\[)(["']XC_STORE["']|(\w+\.)?STORE_ENV)""", line)]
    # the fifth: node_setup/head_boot.py, which runs at a head's boot before any of the project's code is there
    assert len(lookups) <= 5, lookups


def test_no_code_splits_an_errors_text():
    """Errors carry what and fix as fields (core.errors.ClusterError, training.runtime.store.StoreError)."""
    split = [(m, i) for m, i, line in _code_lines() if 'partition("; ")' in line or 'split("; ")' in line]
    assert split == [], split


EVENT_TAGS = ("[progress]", "[finished]", "[preempted]", "[timeline]", "[rebalance]", "[store]")


def _strings(path: Path) -> list[tuple[int, str]]:
    """A module's string constants, its docstrings left out (they may quote a line)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_only_the_event_codec_writes_or_parses_a_ranks_tagged_lines():
    """A rank's progress, end, notice, marks and checkpoint news are RunEvents: training/runtime/events.py alone
    turns them into lines and back; launch, doctor and the jobs handle events."""
    outside = [(name, line, text) for name, path in modules().items() if name != "training.runtime.events"
               for line, text in _strings(path) if _has_tag(text)]
    assert outside == [], outside


def _has_tag(text: str) -> bool:
    """A tag as written, or as a regular expression matches it (its brackets escaped)."""
    plain = text.replace("\\[", "[").replace("\\]", "]")
    return any(tag in plain for tag in EVENT_TAGS)


def test_only_the_event_codec_names_the_ranks_events_file():
    """A rank's events file is written and read as RunEvents by the codec alone; others ask it for events."""
    outside = [(name, line, text) for name, path in modules().items() if name != "training.runtime.events"
               for line, text in _strings(path) if "XC_EVENTS" in text or "events.jsonl" in text]
    assert outside == [], outside


def test_the_tag_check_sees_a_tag_in_code_and_not_in_a_docstring(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""A module that quotes [progress] in its docstring."""\nLINE = f"[finished] rank {0}"\n'
                     'TOTAL = r"\\[progress\\] step \\d+/(\\d+)"\n')
    found = [text for _, text in _strings(probe) if _has_tag(text)]
    assert sorted(found) == ["[finished] rank ", r"\[progress\] step \d+/(\d+)"], found


MAX_INNER_IMPORTS = 10  # a heavy stack only some commands or some ranks need (torch, urllib); each says why


def inner_imports(path: Path) -> list[tuple[int, str]]:
    """(line, source line) of each import of a project module (or a relative one) inside a function body."""
    tops = {*PACKAGES, *TOP}
    lines = path.read_text().splitlines()
    found = {}
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):  # a nested function's imports are seen twice: keyed by position, counted once
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else None
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if names is None or any(n.split(".")[0] in tops for n in names):
                found[(node.lineno, node.col_offset)] = lines[node.lineno - 1]
    return [(line, text) for (line, _), text in sorted(found.items())]


def test_project_imports_inside_functions_are_few_and_said_why():
    """A project module is imported at the top of a module, where its readers and the cycle check see it; the
    few imported inside a function (a stack too heavy for every command or rank) say why on their line."""
    inner = [(name, line, text.strip()) for name, path in modules().items() for line, text in inner_imports(path)]
    assert len(inner) <= MAX_INNER_IMPORTS, inner
    unexplained = [(name, line, text) for name, line, text in inner if "#" not in text]
    assert unexplained == [], unexplained


def test_the_inner_import_count_sees_one_in_a_probe_module(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""from core import errors"""\nimport os\n\n\ndef f():\n    def g():\n'
                     '        from core import errors\n        from . import sibling\n        import json\n'
                     '        return errors, sibling, json\n    return g, os\n')
    assert inner_imports(probe) == [(7, "        from core import errors"), (8, "        from . import sibling")]
