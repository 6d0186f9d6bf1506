"""The process the service runs in: the CPUs it may use (``cpus``), the engine's measured
token rates that admission prices work with (``throughput``) and the fit's worker processes
(``solver_pool``).

Imports nothing of the service but itself.
"""
