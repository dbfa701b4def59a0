"""The search's answer, signed off on data the search never read, and the frontier of what it built.

The ladder (ladder.py) chooses k on the search half of the quality data (pipeline/measure/split.py); its
figures for the candidate it picks are biased upward by the picking (the winner's curse), and it looks at
several candidates. No claim rests on those looks. The claim is made on the sealed half by one stated rule:

    fixed sequence   the candidates and references that passed on search data, ordered from the most to the
                     least costly by the objective (an order fixed before any sealed figure is read), are
                     judged on sealed data in that order, each by the recipe's gates at their own level (their
                     95% intervals); the sequence stops at the first that does not pass. Every candidate
                     confirmed before the stop meets its gates with family-wise error at most the gates' own
                     (the fixed-sequence procedure: each hypothesis is tested only if every one before it was
                     rejected, so no level is divided among the looks). The answer is the cheapest confirmed.

The gap between a candidate's search and sealed figures is reported beside them: for the search's own pick it
measures the winner's curse. Pure: rows in, rows out.
"""

from __future__ import annotations

from statistics import NormalDist

PASSING = ("PASS", "WARN")
Z95 = NormalDist().inv_cdf(0.975)  # the gates' own 95% intervals
REPLICATE = 0.95  # the chance a search look aims for that the sealed half passes too
WIDEN = (Z95 + NormalDist().inv_cdf(REPLICATE)) / Z95
MARGIN_RULE = (f"on the search data a candidate passes only when every fail gate's interval, widened {WIDEN:.2f}x "
               f"(normal approximation from its 95% half-width), clears the threshold: each such gate would pass on a "
               f"sealed half as large with {REPLICATE:.0%} chance were the truth its search estimate (the gates on the "
               f"code windows are sealed only and carry no margin)")
RULE = ("fixed sequence: candidates that passed on search data, from the most to the least costly, judged on "
        "sealed data in that order by the recipe's gates (95% intervals each), stopping at the first that does not "
        "pass; the answer is the cheapest confirmed, and every confirmed one meets its gates with family-wise error "
        "at most the gates' own level")


def gate_rows(gates) -> list[dict]:
    """A sign-off's gates as search.json keeps them: one entry per gate (a fail and a warn gate on one metric
    and scope stay apart)."""
    return [{"gate": f"{g.metric}[{g.scope}]", "value": g.measured.value, "ci_low": g.measured.ci_low,
             "ci_high": g.measured.ci_high, "outcome": g.outcome, "op": g.op, "threshold": g.threshold,
             "severity": g.severity} for g in gates]


def passes_search(row: dict) -> bool:
    """The ladder's look: the row's sign-off on search data passes and every fail gate with an interval clears
    its threshold with the replication margin (MARGIN_RULE). Without it the search's pick passes its sealed
    half little more often than a coin lands heads (tests/test_sealed.py simulates both)."""
    if row["verdict"] not in PASSING:
        return False
    for g in row.get("gates") or []:
        bound = g.get("ci_low") if g.get("op") == ">=" else g.get("ci_high")
        if g.get("severity", "fail") != "fail" or g.get("value") is None or bound is None:
            continue
        half = max(0.0, abs(g["value"] - bound))  # the conservative side's half-width, never negative
        if g["op"] == ">=" and g["value"] - WIDEN * half < g["threshold"]:
            return False
        if g["op"] == "<=" and g["value"] + WIDEN * half > g["threshold"]:
            return False
    return True


def unconfirmed(picked: dict, stopped: str | None) -> str:
    """Why the search data's own pick is not the answer, as the console and the page say it."""
    if stopped == picked["name"]:
        return f"the search data's pick {picked['name']} did not hold on the sealed data"
    return (f"the search data's pick {picked['name']} was not reached: the confirmation stopped at {stopped}, "
            "which did not hold on the sealed data")


def quality_fields(verdict) -> dict:
    """The quality figures a sign-off (a VariantSignoff, or None) gives a frontier row, on whichever half it
    was judged: top-1 and KL on the prose windows, Δ accuracy over the pooled items, with their CIs."""
    d = verdict.drift if verdict else None
    overall = next((p for p in (verdict.paired if verdict else []) if p.slice == "overall"), None)
    return {
        "top1_agreement": d.top1_agreement if d else None, "top1_ci": [d.top1_ci_low, d.top1_ci_high] if d else None,
        "kl_mean": d.kl_mean if d else None,
        "accuracy_delta": overall.delta if overall else None,
        "accuracy_delta_ci": [overall.delta_ci_low, overall.delta_ci_high] if overall else None,
    }


def sealed_fields(verdict) -> dict:
    """What the sealed half says of one candidate or reference (a VariantSignoff judged on it)."""
    d, c = verdict.drift, verdict.drift_code
    overall = next((p for p in verdict.paired if p.slice == "overall"), None)
    return {
        "verdict": verdict.verdict, "reason": verdict.reason, "gates": gate_rows(verdict.gates),
        **quality_fields(verdict), "windows": d.windows if d else 0,
        "code_top1_agreement": c.top1_agreement if c else None,
        "code_top1_ci": [c.top1_ci_low, c.top1_ci_high] if c else None, "code_windows": c.windows if c else 0,
        "items": overall.n if overall else 0,
    }


def gap(row: dict) -> dict:
    """Search figure minus sealed figure, per quality figure both halves have: positive where the search half
    looked better than data it never read."""
    s = row.get("sealed") or {}
    return {k: row[k] - s[k] for k in ("top1_agreement", "accuracy_delta")
            if row.get(k) is not None and s.get(k) is not None}


def cost(row: dict, objective: str) -> tuple | None:
    """What the objective minimises, in order: memory, the weights as loaded natively; capacity, minus the KV
    tokens under the budget (then the weights); latency, p95 TPOT at the conservative end of its 95% interval
    over repeats, the bound a latency gate is judged on (then the weights): a candidate is not called faster on
    the luck of one run. None where the objective's figure was not measured."""
    if row.get("native_weight_bytes") is None:
        return None
    if objective == "latency":
        if row.get("tpot_p95_ms") is None:
            return None
        return ((row.get("tpot_p95_ci") or [None, row["tpot_p95_ms"]])[1], row["native_weight_bytes"])
    if objective == "capacity":
        return (-row["kv_tokens"], row["native_weight_bytes"]) if row.get("kv_tokens") is not None else None
    return (row["native_weight_bytes"],)


def can_answer(row: dict, objective: str) -> bool:
    """Passes the search look and has the objective's figure; a KV-cache twin only where it can buy something
    (capacity or latency: memory cannot tell it from its sibling, and a failing twin would stop the sequence for
    it); never
    an anchor (anchors.py: its bits were matched to the search data's pick, so it is compared, not chosen)."""
    return (passes_search(row) and cost(row, objective) is not None and row.get("kind") != "anchor"
            and (objective != "memory" or row.get("kv_cache", "auto") == "auto"))


def confirm(rows: list[dict], objective: str) -> tuple[dict | None, list[str], str | None]:
    """(the answer: the cheapest confirmed, or None; the names in the order they were judged on sealed data;
    the one the sequence stopped at, or None). Marks each row's "confirmed"."""
    eligible = [r for r in rows if can_answer(r, objective)]
    order = sorted(eligible, key=lambda r: (cost(r, objective), r["name"]), reverse=True)  # most costly first
    for r in rows:
        r["confirmed"] = False
    answer, stopped = None, None
    for r in order:
        if (r.get("sealed") or {}).get("verdict") not in PASSING:
            stopped = r["name"]
            break
        r["confirmed"] = True
        answer = r
    return answer, [r["name"] for r in order], stopped


# the frontier's axes: (row field, better when, label)
AXES = (("native_weight_bytes", "low", "weights as loaded natively"),
        ("kv_tokens", "high", "KV tokens under the budget"),
        ("tpot_p95_ms", "low", "p95 TPOT"),
        ("sealed.top1_agreement", "high", "sealed top-1 agreement"),
        ("sealed.accuracy_delta", "high", "sealed accuracy delta"))


def _value(row: dict, field: str):
    if field.startswith("sealed."):
        return (row.get("sealed") or {}).get(field.split(".", 1)[1])
    return row.get(field)


def frontier(rows: list[dict]) -> dict:
    """Marks "pareto" on every row that passes its sealed half and that no other such row beats on every axis
    measured for all of them (at least as good on each, better on one); the axes left out are named."""
    pts = [r for r in rows if (r.get("sealed") or {}).get("verdict") in PASSING  # shippable points only
           and r.get("native_weight_bytes") is not None]
    for r in rows:
        r["pareto"] = False
    if not pts:
        return {"axes": [], "not_measured_for_every_point": [], "note": "no candidate or reference passed its "
                "sealed half: there is no frontier of shippable points"}
    used = [(f, better) for f, better, _ in AXES if all(_value(r, f) is not None for r in pts)]
    left_out = [label for f, _, label in AXES if (f, "low") not in used and (f, "high") not in used]

    def key(r: dict) -> list[float]:
        return [_value(r, f) if better == "high" else -_value(r, f) for f, better in used]

    for r in pts:
        mine = key(r)
        r["pareto"] = not any(all(a >= b for a, b in zip(key(o), mine, strict=True)) and key(o) != mine
                              for o in pts if o is not r)
    return {"axes": [label for f, better, label in AXES if (f, better) in used],
            "not_measured_for_every_point": left_out}
