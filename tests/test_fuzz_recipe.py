"""Fuzz the recipe loader: any YAML text or structure ends in a Recipe or one RecipeError line."""

from __future__ import annotations

import string

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.recipe.schema import Recipe, RecipeError, load

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12))
trees = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                   st.dictionaries(st.text(string.ascii_lowercase + "_",
                                                                           max_size=12), c, max_size=5)),
                     max_leaves=20)
KEYS = ["schema_version", "name", "model", "engine", "calibration", "variants", "quality", "workload",
        "gates", "runs_dir"]


def check(tmp_path, text: str) -> None:
    p = tmp_path / "fuzz.yaml"
    p.write_text(text)
    try:
        assert isinstance(load(p), Recipe)
    except RecipeError as exc:
        msg = str(exc)
        assert msg.startswith(str(p)) and "\n" not in msg and "Traceback" not in msg


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_arbitrary_text(tmp_path, text):
    check(tmp_path, text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(KEYS), trees, max_size=len(KEYS)))
def test_arbitrary_structures_with_real_keys(tmp_path, data):
    check(tmp_path, yaml.safe_dump(data))


# Examples hypothesis found that once escaped as non-RecipeError; kept as regressions.
def test_found_examples(tmp_path):
    for text in ["\x00", "a: !!binary 'x'", "? [a]\n: 1", "'", "a: 1\na: 2", "{name: [}]", "\x1f"]:
        check(tmp_path, text)
