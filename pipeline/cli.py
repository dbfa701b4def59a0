"""quantize-eval: which quantized variant do we ship, and what does it cost?

    quantize-eval RECIPE            run (same as `run RECIPE`); exit 0 pass, 1 a gate fails,
                                    4 a fail gate unmeasurable here, 5 one undecided (INCONCLUSIVE)
    quantize-eval run RECIPE [--fresh]
    quantize-eval search RECIPE     the cheapest mixed-precision variant whose gates pass (the
                                    recipe's search section); exit 0 found, 1 none passed
    quantize-eval validate RECIPE   check a recipe without running anything
    quantize-eval report RUN_DIR    re-render report.html/results.json from a run folder
                                    (--model-card: also model-card.md, the published cards' table)
    quantize-eval compare A B       what changed between two runs; exit 1 on a regression,
                                    3 when the runs are not like for like, or one is unfinished
                                    or lacks a variant or suite the other has
    quantize-eval make-legacy MODEL OUT --format gptq|awq
                                    an RTN 4-bit checkpoint in AutoGPTQ/AutoAWQ layout, to
                                    try `scheme: import` (recipes/import.yaml)

Bad input exits 2 with one line naming the field or file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

USAGE_ERROR = 2


def fail(msg: str) -> int:
    print(f"quantize-eval: error: {msg}", file=sys.stderr)
    return USAGE_ERROR


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantize-eval", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="run a recipe end to end")
    p_run.add_argument("recipe")
    p_run.add_argument("--fresh", action="store_true", help="start a new run folder, no resume")
    p_run.add_argument("--quiet", action="store_true", help="no progress lines: the stage summaries and the verdict")
    p_run.add_argument("--ray", metavar="ADDRESS", help="run variants as Ray tasks: 'local' (a private Ray "
                       "instance here), 'auto' (the cluster this machine is in) or a cluster address; "
                       "overrides the recipe's executor section")
    p_search = sub.add_parser("search", help="find the cheapest mixed-precision variant that passes the gates")
    p_search.add_argument("recipe")
    p_search.add_argument("--fresh", action="store_true", help="start a new run folder, no resume")
    p_search.add_argument("--quiet", action="store_true", help="no progress lines")
    p_stage = sub.add_parser("_stage")  # internal: one stage of one variant, run by a Ray task
    for a in ("stage", "recipe", "run_dir", "variant"):
        p_stage.add_argument(a)
    p_val = sub.add_parser("validate", help="check a recipe without running anything")
    p_val.add_argument("recipe")
    p_val.add_argument("--support", action="store_true",
                       help="also say how this machine's engine would run each variant (asks the engine)")
    p_rep = sub.add_parser("report", help="re-render the report of a run folder")
    p_rep.add_argument("run_dir")
    p_rep.add_argument("--model-card", action="store_true", help="also write RUN_DIR/model-card.md: per task, "
                       "baseline, variant and recovery as model cards print them, with the paired interval and flips")
    p_cmp = sub.add_parser("compare", help="what changed between two runs, beyond noise")
    p_cmp.add_argument("run_a")
    p_cmp.add_argument("run_b")
    p_leg = sub.add_parser("make-legacy", help="write an RTN 4-bit checkpoint in AutoGPTQ/AutoAWQ layout")
    p_leg.add_argument("model_dir")
    p_leg.add_argument("out_dir")
    p_leg.add_argument("--format", choices=("gptq", "awq"), required=True)
    p_leg.add_argument("--group", type=int, default=64)
    return p


def cmd_compare(args) -> int:
    from reports.compare import CompareError, compare

    try:
        lines, regressed, alike, absent = compare(Path(args.run_a), Path(args.run_b))
    except CompareError as exc:
        return fail(str(exc))
    print("\n".join(lines))
    return 3 if absent else 1 if regressed else (3 if not alike else 0)


def cmd_make_legacy(args) -> int:
    from pipeline.store import legacy_formats

    src, out = Path(args.model_dir), Path(args.out_dir)
    if not (src / "config.json").is_file():
        return fail(f"{src}: not a model directory (no config.json)")
    if (out / "config.json").exists():
        return fail(f"{out}: already holds a checkpoint; remove it or pick another folder")
    try:
        legacy_formats.write(src, out, args.format, args.group)
    except (ValueError, RuntimeError, KeyError) as exc:
        return fail(f"{src}: cannot write a {args.format} checkpoint: {str(exc).splitlines()[0]}")
    print(out)
    return 0


def cmd_report(args) -> int:
    from reports.render import ReportError, render_run

    try:
        print(render_run(Path(args.run_dir)))
        if args.model_card:
            from reports.modelcard import write_model_card

            print(write_model_card(Path(args.run_dir)))
    except ReportError as exc:
        return fail(str(exc))
    return 0


def _model_dir(recipe) -> Path:
    from pipeline.setup import models

    return models.model_dir(recipe.model.builtin) if recipe.model.builtin else Path(recipe.model.path).resolve()


def cmd_validate(args, recipe) -> int:
    from pipeline.run import preflight

    try:
        pending = preflight.for_validate(recipe, Path(args.recipe))
    except preflight.PreflightError as exc:
        return fail(str(exc))
    print(f"{args.recipe}: ok ({len(recipe.variants)} variant(s) + baseline, {len(recipe.gates)} gate(s))"
          + (f"; {pending}" if pending else ""))
    if recipe.search:
        sp = recipe.search
        parts = {"blocks": "decoder blocks", "blocks_and_kinds": "decoder blocks and Linear kinds",
                 "block_kinds": "Linear kinds within blocks"}[sp.units]
        print(f"  search: {sp.base_scheme} g{sp.group_size or 'channel'}, {parts} kept at "
              f"{' then '.join(sp.fallbacks)} by measured sensitivity, objective {sp.objective}, at most "
              f"{sp.max_builds} candidate(s)" + (f"; head-to-head with {', '.join(sp.anchors)} at the pick's bits "
                                                   "(a build each, outside that cap)" if sp.anchors else "")
              + f"; run it with `quantize-eval search {args.recipe}`")
    for line in preflight.power_statements(recipe):
        print("  power: " + line)
    memory = None if pending else preflight.budget_statement(recipe, _model_dir(recipe))
    if memory:
        print("  memory: " + memory)
    if args.support:
        from pipeline.run import runner

        for name, d in runner.support_table(recipe):
            print(f"  {name:>24}  {d.mode:<11} {d.compute or '–':<10} {d.reason}")
    return 0


def cmd_run(args, recipe) -> int:
    import os
    import signal

    from pipeline import progress
    from pipeline.run import runner

    if args.quiet:
        os.environ[progress.QUIET_ENV] = "1"  # stage processes (Ray) inherit it

    def _terminate(signum, frame):  # SIGTERM/SIGHUP unwind like Ctrl-C, so engines get reaped
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    if args.cmd == "run" and not recipe.variants:
        return fail(f"{args.recipe}: variants: none to run; this recipe only searches: "
                    f"quantize-eval search {args.recipe}")
    try:
        if args.cmd == "search":
            from pipeline.search import ladder as search

            if recipe.search is None:
                return fail(f"{args.recipe}: search: this recipe has no search section (see recipes/search.yaml)")
            return search.search(recipe, Path(args.recipe), fresh=args.fresh)
        return runner.run(recipe, Path(args.recipe), fresh=args.fresh)
    except (runner.PreflightError, runner.RunLocked) as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print("\ninterrupted: finished stages are kept; rerun the same command to resume", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("run", "search", "validate", "report", "compare", "make-legacy", "_stage", "-h", "--help"):
        argv.insert(0, "run")
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:
        return USAGE_ERROR if exc.code else 0
    no_recipe = {"compare": cmd_compare, "make-legacy": cmd_make_legacy, "report": cmd_report}
    if args.cmd in no_recipe:
        return no_recipe[args.cmd](args)
    from pipeline.recipe.schema import RecipeError, load

    try:
        recipe = load(args.recipe)
    except RecipeError as exc:
        return fail(str(exc))
    if getattr(args, "ray", None):
        ex = recipe.executor.model_copy(update={"kind": "ray", "address": None if args.ray == "local" else args.ray})
        recipe = recipe.model_copy(update={"executor": ex})
    if args.cmd == "_stage":
        from pipeline.run import runner

        return runner.stage_main(recipe, Path(args.recipe), Path(args.run_dir), args.variant, args.stage)
    if args.cmd == "validate":
        return cmd_validate(args, recipe)
    return cmd_run(args, recipe)


if __name__ == "__main__":
    sys.exit(main())
