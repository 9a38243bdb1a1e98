"""The rules of docs/architecture.md, checked on the source: no import cycles, no module
over 500 lines, torch only under planc/runtime, a runtime that reads the build, not
the compiler's inputs, and instructions' ops and guards compared as members, never text.

Imports are read from the source (nothing is imported), every ``import`` counts, at
module level or inside a function: an import deferred into a function to dodge a cycle
is still a cycle of meaning. Only imports under ``if TYPE_CHECKING:`` do not count: they
never run, and serve annotations alone.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "planc"
MAX_LINES = 500

# The runtime executes what the compiler wrote. Only the single-process reference (the
# oracle of planc run --check), the check that compares against it and calibrate (which
# compiles and runs tiny plans of its own to time the runtime's instructions) build
# anything from the plan.
RUNTIME_MAY_READ_THE_PLAN = {"planc.runtime.oracle.reference", "planc.runtime.oracle.check",
                             "planc.runtime.calibrate", "planc.runtime.calibrate_instructions"}
COMPILER_INPUTS = ("networkx", "planc.plan.plan", "planc.models", "planc.plan.layout",
                   "planc.graph.derive", "planc.graph.axes", "planc.graph.tensor_parallel",
                   "planc.graph.parameters", "planc.estimate.model")


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _annotations_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
                isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" or
                isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"):
            skipped.update(id(inner) for child in node.body for inner in ast.walk(child))
    return skipped


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module ``name`` imports: planc's by module name, others by their top name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped = _annotations_only(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "planc":
                found.add(target)
                continue
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> nx.DiGraph:
    known = modules()
    graph = nx.DiGraph()
    for name, path in known.items():
        graph.add_node(name)
        graph.add_edges_from((name, target) for target in imported(name, path, known))
    return graph


def test_no_import_cycles():
    graph = import_graph().subgraph(modules())
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert cycles == []


def test_no_module_is_over_500_lines():
    lengths = {name: len(path.read_text(encoding="utf-8").splitlines())
               for name, path in modules().items()}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


def test_torch_is_imported_only_by_the_runtime():
    graph = import_graph()
    users = {name for name in modules() if any(t.split(".")[0] == "torch"
                                               for t in graph.successors(name))}
    assert users and all(name.startswith("planc.runtime") for name in users), sorted(users)


def test_the_runtime_reads_the_build_not_the_compilers_inputs():
    graph = import_graph()
    found = {}
    for name in modules():
        if not name.startswith("planc.runtime") or name in RUNTIME_MAY_READ_THE_PLAN:
            continue
        reads = sorted(t for t in graph.successors(name)
                       if any(t == c or t.startswith(c + ".") for c in COMPILER_INPUTS))
        if reads:
            found[name] = reads
    assert found == {}


def test_a_rank_loads_none_of_the_compilers_inputs(tmp_path):
    """Not only the runtime's own imports: a worker that reads a build (planc.build.files)
    and sets up its run loads no module of the language, the plan, the models, the layout,
    the cost model or the derivation, directly or through another module."""
    from planc.cli import main

    plan = tmp_path / "one.plan"
    plan.write_text("plan one {\n  model gpt { layers = 2; hidden = 32; heads = 2; vocab = 64; "
                    "seq = 8; batch = 4 }\n  mesh { dp = 2 }\n}\n")
    assert main(["compile", str(plan), "-o", str(tmp_path / "b")]) == 0
    code = ("import sys; from planc.runtime import worker; from planc.runtime.checkpoint import checkpoints; from planc.runtime.engine import executor; "
            "from planc.build.files import read_for_run; "
            f"read_for_run({str(tmp_path / 'b')!r}); "
            "print(sorted(m for m in sys.modules if m == 'networkx' or m == 'lark' or "
            "m.startswith('planc.') and not m.startswith('planc.runtime')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    loaded = ast.literal_eval(out)
    forbidden = [m for m in loaded if m in ("networkx", "lark") or any(
        m == c or m.startswith(c + ".") for c in COMPILER_INPUTS + (
            "planc.lang", "planc.estimate.cost", "planc.estimate.memory", "planc.schedules", "planc.passes",
            "planc.graph.ir", "planc.lower.lower", "planc.verify.verifier"))]
    assert forbidden == [], forbidden
    assert "planc.program.program" in loaded and "planc.build.files" in loaded


# The layers of planc, lowest first (docs/architecture.md, "Layers"): a module imports
# only from its own layer or one below it. A package stands for every module under it;
# a name in one layer's tuple may not import another of the same tuple unless it is
# the same package.
LAYERS = (
    ("planc", "planc.diagnostics", "planc.host"),
    ("planc.vocabulary",),
    ("planc.models", "planc.schedules"),
    ("planc.plan",),
    ("planc.program",),
    ("planc.estimate", "planc.data", "planc.checkpoint"),
    ("planc.hf",),
    ("planc.lang",),
    ("planc.graph",),
    ("planc.passes",),
    ("planc.lower",),
    ("planc.verify",),
    ("planc.build",),
    ("planc.compile",),
    ("planc.runtime", "planc.simulate"),
    ("planc.tune", "planc.export"),
    ("planc.views",),
    ("planc.commands",),
    ("planc.cli",),
    ("planc.__main__",),
)
MAX_ROOT_MODULES = 6
MAX_MODULES_PER_FOLDER = 20


def layer_of(module: str) -> tuple[int, str]:
    """The layer of ``module`` and the package that places it there (the longest match)."""
    best = None
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".") and name != "planc") and (
                    best is None or len(name) > len(best[1])):
                best = (index, name)
    if best is None and module.count(".") == 0:
        best = (0, "planc")
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best


def test_every_module_has_a_layer():
    assert all(layer_of(name) for name in modules())


def test_no_import_runs_up_the_layers():
    graph = import_graph()
    upward = []
    for name in modules():
        here, home = layer_of(name)
        for target in graph.successors(name):
            if not target.startswith("planc"):
                continue
            there, other = layer_of(target)
            if there > here or there == here and other != home:
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_the_root_holds_only_the_entry_points_and_no_folder_is_crowded():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root
    crowded = {str(d.relative_to(ROOT)): n for d in [PACKAGE, *PACKAGE.rglob("*")]
               if d.is_dir() and (n := len(list(d.glob("*.py")))) > MAX_MODULES_PER_FOLDER}
    assert crowded == {}


# Modules whose ``op`` is not an instruction's: the language's binary operators
# (planc.vocabulary.kinds, planc.lang: "+", "-", ...) and the graph's operators
# (planc.graph, planc.models: "embedding", "loss", ... keyed by the families' rules).
OTHER_VOCABULARIES_OF_OP = ("planc.vocabulary.kinds", "planc.lang", "planc.graph",
                            "planc.models")


def _called_op_or_guard(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else \
        node.attr if isinstance(node, ast.Attribute) else None
    return name in ("op", "guard")


def _text(node: ast.AST) -> bool:
    """A string constant, or a tuple, list or set of them."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_text(item) for item in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def string_comparisons_of_op(path: Path) -> list[int]:
    """The lines of ``path`` that compare an ``op`` or ``guard`` with text."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for left, right in zip(sides, sides[1:]):
            if _called_op_or_guard(left) and _text(right) or \
                    _called_op_or_guard(right) and _text(left):
                lines.append(node.lineno)
    return lines


def test_no_instruction_op_or_guard_is_compared_with_text():
    """Instructions carry an Opcode and a Guard (planc.program.instruction_set): code
    compares members, so a renamed or mistyped op cannot silently never match."""
    found = [f"{path.relative_to(ROOT)}:{line}" for name, path in modules().items()
             if not any(name == other or name.startswith(other + ".")
                        for other in OTHER_VOCABULARIES_OF_OP)
             for line in string_comparisons_of_op(path)]
    assert found == []


def test_the_op_scan_sees_a_comparison_with_text(tmp_path):
    source = tmp_path / "example.py"
    source.write_text('if item.op == "wait" or op in ("send", "recv") or '
                      'i.guard != "last":\n    pass\nif item.op is WAIT:\n    pass\n')
    assert string_comparisons_of_op(source) == [1, 1, 1]
