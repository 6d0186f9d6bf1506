"""The ways in: the one command line (``cli``, installed as ``rag-reorder``; ``python -m
entrypoints`` is the same), the server's launch (``server``: uvicorn, signals, drain) and its
worker processes on one engine (``workers``).

Above everything else: it reaches the HTTP edge (``app``) and the offline tooling
(``offline``), which never import each other or this package.
"""
