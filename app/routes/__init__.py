"""The HTTP routes, one module per family: reorder, rerank, profiles, feedback, info and
the probes."""
