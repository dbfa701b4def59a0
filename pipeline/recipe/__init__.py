"""Recipe: what a run compares, validated before anything runs.

The schema (`schema`, with the engine and workload in `serving` and the search section in
`search_section`), the YAML loader and the checks of the files a recipe names (`files`), and the
rules for which gates apply to which suites and slices (`gatecheck`). The tables of schemes and
builtin suites it validates against are `pipeline/schemes.py` and `pipeline/suitetable.py`.
"""
