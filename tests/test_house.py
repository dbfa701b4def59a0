"""The house stays easy to live in: no import cycle, stage modules that do not reach into each
other, and folders by concept that each stand on the ones below and never import one above.
Module and function length are docs/house.md's contributor guidance, not a rule that forces splits."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "reports", "evalsuites", "benchmarks")
# pipeline's floors, top to bottom: a unit imports only units below it (a folder, or a ground module)
LAYERS = (
    ("pipeline.cli",), ("pipeline.search",), ("pipeline.run",), ("pipeline.stages",),
    ("pipeline.store",), ("pipeline.recipe",), ("pipeline.measure", "pipeline.suites"), ("pipeline.engines",),
    ("pipeline.setup",),
    ("pipeline.results", "pipeline.progress", "pipeline.runstore", "pipeline.schemes",
     "pipeline.suitetable"),
)
# stage modules each measure one thing; only evaluate.py (one engine start) calls the three
# that share its engine
STAGES = {"quantize", "quality", "systems", "admission", "signoff", "evaluate", "sensitivity", "agreement"}
# the agreement check scores the reference engine the way quality scores the serving one
MAY_CALL = {"evaluate": {"quality", "systems", "admission"}, "agreement": {"quality"}}


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
    assert "pipeline.runstore" in g["pipeline.run.runner"]


def floor_of(mod: str) -> int | None:
    for i, units in enumerate(LAYERS):
        if any(mod == u or mod.startswith(u + ".") for u in units):
            return len(LAYERS) - i
    return None


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in g.items():
        here = floor_of(mod)
        for dep in deps:
            there = floor_of(dep)
            if here is not None and there is not None and there >= here and \
                    dep.split(".")[:2] != mod.split(".")[:2]:
                bad.append(f"{mod} -> {dep}")
    return sorted(bad)


def test_no_import_runs_back_up_the_layers():
    src = sources()
    unplaced = [m for m in src if m.startswith("pipeline.") and floor_of(m) is None and m != "pipeline"]
    assert not unplaced, f"modules on no floor of LAYERS (place them): {unplaced}"
    assert upward_imports(graph()) == []


def test_the_layer_check_sees_an_upward_import():
    g = {"pipeline.measure.stats": {"pipeline.stages.quality"}, "pipeline.stages.quality": {"pipeline.measure.stats"},
         "pipeline.measure.drift": {"pipeline.suites"}}  # same floor: sideways, also refused
    assert upward_imports(g) == ["pipeline.measure.drift -> pipeline.suites",
                                 "pipeline.measure.stats -> pipeline.stages.quality"]


def engine_reach(g: dict[str, set[str]]) -> list[str]:
    """Imports of an engine kind's folder (pipeline.engines.<kind>) from outside it: every stage talks to
    pipeline/engines/interface.py, which finds the kind by its name, so adding an engine touches only its
    own folder."""
    kinds = {p.name for p in (ROOT / "pipeline" / "engines").iterdir() if (p / "__init__.py").exists()} - {"workers"}
    bad = []
    for mod, deps in g.items():
        for dep in deps:
            parts = dep.split(".")
            if len(parts) > 2 and parts[:2] == ["pipeline", "engines"] and parts[2] in kinds and \
                    mod.split(".")[:3] != parts[:3]:
                bad.append(f"{mod} -> {dep}")
    return sorted(bad)


def test_only_an_engines_own_folder_imports_it():
    assert engine_reach(graph()) == []
    assert engine_reach({"pipeline.stages.systems": {"pipeline.engines.vllm.server"},
                         "pipeline.engines.vllm": {"pipeline.engines.vllm.server"}}) == \
        ["pipeline.stages.systems -> pipeline.engines.vllm.server"]
