"""``auto``'s learner: the scoring model's position profile learned from the MoI runs it
serves, whether it is trusted yet, whether it still holds, and the background runs that learn.

One lifecycle in one module (``learner``), kept whole: its trust, spooling and scheduling share
one lock and one set of counters, and each step reads the others' state.

Imports ``state``, ``backends`` (the protocol), ``config`` and ``errors``; never strategies or
the pipeline, which use it.
"""
