"""``auto``'s learner: the scoring model's position profile learned from the MoI runs it
serves, whether it is trusted yet, whether it still holds, and the background runs that learn.

One lifecycle in one module (``learner``), kept whole: its trust, spooling and scheduling share
one lock and one set of counters, and each step reads the others' state. Beside it,
``generator_online`` learns the generator's profile from its own answers to sampled requests
(``generator_url``), which ``learner`` places by first.

Imports ``prompting`` (the generator's prompt), ``state``, ``backends``, ``config`` and
``errors``; never strategies or the pipeline, which use it.
"""
