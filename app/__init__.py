"""The HTTP edge: the app factory (``main``), routes, wire models (``schemas``), the error
table (``errors``), middleware, input limits and the conversions between wire models and the
domain's types.

The only package that speaks HTTP; it turns requests into calls on the serving runtime
(``serving``: admission, execution, the engine's supervision) and ``service``, and results
back into wire models. It is launched by ``entrypoints``.
"""
