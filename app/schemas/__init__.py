"""Wire models of the HTTP API (docs/api.md), one module per route family (``reorder``,
``rerank``, ``profiles``, ``feedback``, ``info``) on one ``base`` (the caps, the strict and lenient
models, the error envelope).

Native models forbid unknown fields, so a misspelt option is a 422 and not a silent default;
the rerank models ignore them (Cohere, Jina and vLLM clients send fields we do not use), except
inside our own ``reorder`` object. Every string and list is bounded in its type; the
configurable limits (``Settings.max_*``) are checked after parsing so their errors can name the
limit and the value. Numbers must be finite: Python's JSON parser accepts ``NaN`` and turns
``1e999`` into infinity, and neither may reach the solver.
"""
