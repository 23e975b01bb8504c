"""The package's imports point one way (docs/architecture.md): no cycle, no upward import,
and function-local imports only where they keep torch or a slow command off the common path.

Walks every module's syntax tree (ast), so it checks the code as written, including imports
inside functions and under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vramcalc"

# Layers from the bottom up: a module may import from its own layer or any layer below.
# The first matching prefix wins (longest prefixes first where they nest).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("vramcalc.errors", "vramcalc.units", "vramcalc.safeio",
              "vramcalc.allocator",
              "vramcalc.qlora", "vramcalc.stack_rules", "vramcalc.peft_file", "vramcalc.lora_targets",
              "vramcalc.hf_reader", "vramcalc.seq2seq_shapes", "vramcalc.encoder_shapes")),
    ("types", ("vramcalc.model", "vramcalc.model_tensors", "vramcalc.training",
               "vramcalc.hardware", "vramcalc.parallel",
               "vramcalc.scenario", "vramcalc.report", "vramcalc.catalog", "vramcalc.hf_config",
               "vramcalc.hf_seq2seq", "vramcalc.hf_modernbert", "vramcalc.hub",
               "vramcalc.features", "vramcalc.ds_config", "vramcalc.hf_stack",
               "vramcalc.options", "vramcalc.provenance", "vramcalc.lengths",
               "vramcalc.evidence")),
    ("shapes", ("vramcalc.sharding", "vramcalc.finetune", "vramcalc.peft_moe", "vramcalc.rank",
                "vramcalc.terms.context")),
    ("terms", ("vramcalc.terms", "vramcalc.offload")),
    ("engine", ("vramcalc.analytic", "vramcalc.analytic_seq2seq", "vramcalc.phases",
                "vramcalc.notes", "vramcalc.trace")),
    ("use", ("vramcalc.planner", "vramcalc.serve", "vramcalc.speed", "vramcalc.flops",
             "vramcalc.size", "vramcalc.explain", "vramcalc.explain_seq2seq", "vramcalc.explain_loss",
             "vramcalc.check", "vramcalc.ds_json", "vramcalc.recipe_files", "vramcalc.recipe_llamafactory", "vramcalc.recipe_trl", "vramcalc.recipe_hf",
             "vramcalc.validate",
             "vramcalc.probe",
             "vramcalc.api")),
    # the package itself: the public names of vramcalc.api, loaded on first access
    ("public", ("vramcalc",)),
    ("render", ("vramcalc.render",)),
    ("cli", ("vramcalc.cli", "vramcalc.__main__")),
)
# Function-local imports allowed outside the torch engines (trace/, probe/): the acceptance
# limit of the restructuring; each one should import torch or a lazily loaded command.
MAX_LOCAL_IMPORTS = 15


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            nested = prefix != "vramcalc" and module.startswith(prefix + ".")
            if (module == prefix or nested) and len(prefix) > best:
                best, rank = len(prefix), i
    return rank


def _imports(module: str, path: Path) -> list[tuple[str, bool]]:
    """(imported vramcalc module, inside a function) for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    local: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            if mod == "vramcalc":  # `from vramcalc import safeio` loads the submodule only
                names = [n for n in names[1:] if n in MODULES] or [mod]
        for name in names:
            if name in MODULES and name != module:
                out.append((name, id(node) in local))
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer() -> None:
    assert [m for m in MODULES if _layer(m) < 0] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_upward_import(module: str) -> None:
    up = sorted({name for name, _ in GRAPH[module] if _layer(name) > _layer(module)})
    assert up == [], f"{module} ({LAYERS[_layer(module)][0]}) imports from above: {up}"


def test_no_import_cycle() -> None:
    edges = {m: sorted({n for n, _ in deps}) for m, deps in GRAPH.items()}
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in edges[m]:
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


def test_few_function_local_imports() -> None:
    local = sorted(f"{m} -> {n}" for m, deps in GRAPH.items() for n, inside in deps
                   if inside and not m.startswith(("vramcalc.trace", "vramcalc.probe")))
    # import statements inside functions (any module, torch included), once each
    statements = 0
    for m, path in MODULES.items():
        if m.startswith(("vramcalc.trace", "vramcalc.probe")):
            continue
        inside: set[int] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside |= {id(n) for n in ast.walk(node)
                           if isinstance(n, (ast.Import, ast.ImportFrom))}
        statements += len(inside)
    assert statements <= MAX_LOCAL_IMPORTS, "\n".join(local)


def test_no_module_over_500_lines() -> None:
    long = {m: n for m, p in MODULES.items()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert long == {}
