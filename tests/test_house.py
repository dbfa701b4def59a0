"""The house stays easy to live in: small modules, short functions, no import cycle, and stage
modules that do not reach into each other (the shapes the reshaping issue asked for, held)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "reports", "evalsuites", "benchmarks")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# stage modules each measure one thing; only evaluate.py (one engine start) calls the three
# that share its engine
STAGES = {"quantize", "quality", "systems", "admission", "signoff", "evaluate", "reserve", "sensitivity"}
MAY_CALL = {"evaluate": {"quality", "systems", "admission"}}


def sources() -> dict[str, Path]:
    """module name -> file, for every Python file of the project (tests excluded)."""
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(mod: str, path: Path, known: set[str]) -> set[str]:
    """Project modules this one imports, at any depth of the file (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n in known and n != mod}
    return found


def test_modules_are_small():
    big = {m: n for m, p in sources().items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_functions_are_short():
    long = []
    for mod, path in sources().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{mod}.{node.name} ({n})")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def graph() -> dict[str, set[str]]:
    src = sources()
    return {m: imports(m, p, set(src)) for m, p in src.items()}


def test_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m], _ = 1, stack.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(g):
        if m not in state and (cycle := visit(m)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_stage_modules_do_not_import_each_other():
    g = graph()
    bad = []
    for stage in STAGES:
        for dep in g.get(f"pipeline.stages.{stage}", ()):
            other = dep.removeprefix("pipeline.stages.")
            if dep.startswith("pipeline.stages.") and other in STAGES and other not in MAY_CALL.get(stage, ()):
                bad.append(f"{stage} -> {other}")
    assert not bad, bad


def test_the_checks_see_the_house():
    """The checks above are only as good as what they read: every stage module and a cycle are seen."""
    g = graph()
    assert {f"pipeline.stages.{s}" for s in STAGES} <= set(g)
    assert "pipeline.stages.quality" in g["pipeline.stages.evaluate"]
    assert "pipeline.runstore" in g["pipeline.runner"]
