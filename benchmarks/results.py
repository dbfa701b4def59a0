"""Where a benchmark writes its figures: one Markdown file per benchmark under benchmarks/results/,
one dated row per invocation (kind, command, median and spread of its runs), newest last.

The README links the folder; docs/performance.md says what each figure means. A row is written by
the benchmark that measured it, never by hand, so a figure always carries its kind, date and command.
"""

from __future__ import annotations

import datetime as dt
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

DIR = Path(__file__).resolve().parent / "results"


def spread(values: list[float], unit: str = "s", digits: int = 1) -> str:
    """'median M unit (spread S: v1, v2, ...)' of several runs."""
    med = statistics.median(values)
    return (f"median {med:.{digits}f} {unit} (spread {max(values) - min(values):.{digits}f}: "
            + ", ".join(f"{v:.{digits}f}" for v in values) + ")")


def append(name: str, title: str, header: list[str], row: list[str]) -> Path:
    """Append one row to benchmarks/results/NAME.md (created with TITLE and HEADER on first use); the
    row is prefixed with the date, this machine's CPU kind and the command that printed it."""
    sys.path.insert(0, str(DIR.parent.parent))
    from pipeline.setup.host import cpu_kind

    path = DIR / f"{name}.md"
    DIR.mkdir(exist_ok=True)
    cols = ["date (UTC)", "kind", *header, "command"]
    if not path.exists():
        path.write_text(f"# {title}\n\nWritten by `benchmarks/{name}.py`; one row per invocation.\n\n"
                        f"| {' | '.join(cols)} |\n|{'---|' * len(cols)}\n")
    command = "python3 " + " ".join(shlex.quote(a) for a in [f"benchmarks/{name}.py", *sys.argv[1:]])
    cells = [dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"), cpu_kind(), *row,
             f"`{command}`" + (f" at {commit}" if (commit := _commit()) else "")]
    with path.open("a") as f:
        f.write("| " + " | ".join(c.replace("|", "/") for c in cells) + " |\n")
    return path


def _commit() -> str:
    """The checkout's commit (with '+' when it has uncommitted changes): which code a figure measured."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=DIR, capture_output=True, text=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=DIR, capture_output=True,
                               text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return head + ("+" if dirty and head else "")
