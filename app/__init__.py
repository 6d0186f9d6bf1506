"""The ways in: the HTTP service (FastAPI app factory, routes, wire models, the error table,
admission, middleware, probes and metrics) and the one command line (``cli``).

The only package that speaks HTTP; it turns requests into ``service`` calls and results back
into wire models.
"""
