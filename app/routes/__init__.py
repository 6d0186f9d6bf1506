"""The HTTP routes, one module per family: reorder, rerank, profiles, info and the probes."""
