"""Measure: the arithmetic and statistics every number is computed with, free of any engine.

Gate metrics and the one function computing each (`metrics`), paired statistics (`stats`), the
power of a gate at its n (`power`), token-level drift (`drift`), KV-cache arithmetic (`capacity`),
each engine's pool under the memory budget (`membudget`) and what its own sizing does not count
(`overhead`), and the serving prompts (`prompts`).
"""
