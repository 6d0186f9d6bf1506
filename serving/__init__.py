"""The serving runtime: what a server process runs between the HTTP edge (``app``) and the
domain (``service``).

- ``context``: the process's one typed context (settings, lifecycle, engine, admission,
  metrics) and the lifecycle the probes report.
- ``admission``: whether a request may have the engine now, and for how long (its folder's
  docstring says what it decides and why).
- ``execution``: one request's work under admission, its deadline and its client's presence.
- ``supervisor``: load, warm up and watch the engine; a dead one stops the process.
- ``canaries``: the warm-up and canary probe, and the rate canary that re-measures the
  engine's rates for admission.
- ``metrics``: the Prometheus series of all of the above.
"""
