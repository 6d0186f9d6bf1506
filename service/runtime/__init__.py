"""The process the service runs in: the CPUs it may use (``cpus``), the engine's measured
token rates that admission prices work with (``throughput``), the fit's worker processes
(``solver_pool``) and the lower-priority process for the service's own work
(``background``), both spawned worker processes of one kind (``processes``).

Imports nothing of the service but itself.
"""
