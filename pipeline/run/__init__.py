"""Run: one recipe from start to verdict.

The runner orders the stages of a run, skips finished ones and isolates each variant's failures
(`runner`); the checks made before any work once the model is known (`preflight`); the Ray executor
that runs the same stages as Ray tasks (`ray_executor`).
"""
