"""The speed and memory benchmarks: what the service costs and how fast it serves.

Each script runs from the checkout's root as ``python -m bench.<name>`` (``--help`` says what
it measures; ``--out`` defaults to ``results/bench/<name>.json``). The modules the scripts share
are ``report`` (the command line and the result file), ``workload`` (the requests and the
engine's ceiling), ``server_process`` (a server in its own process) and ``overload``. The
quality evaluations are elsewhere: ``rag-reorder eval`` (``offline/evaluation``) is the product's
own, ``eval/`` drives and compares its runs; ``scripts/device/`` is how either runs on a GPU.
"""
