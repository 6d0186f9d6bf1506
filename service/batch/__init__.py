"""Work over a question file rather than one request: the QA set format (``dataset``),
calibrating a bias profile from a set of queries (``calibration``) and what the two command
lines share (``commandline``).

The top of the service: it drives the pipeline and strategies; nothing in the request path
imports it.
"""
