"""Search: the cheapest variant that still passes the gates (`quantize-eval search`).

The ladder of mixed-precision candidates guided by measured sensitivity (`ladder`) and one
candidate's llm-compressor recipe (`mixed`); each candidate runs as an ordinary variant of a run.
"""
