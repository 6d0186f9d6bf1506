"""Text in and out of the model: prompt building (``prompts``: query, passages and order to
token ids and scored spans), the named prompt templates (``templates``) and the answer rules
(``answers``: normalisation, QA metrics, the vote).

Imports ``backends`` (the tokenizer protocol), ``passage`` and ``errors``; never state or
learning.
"""
