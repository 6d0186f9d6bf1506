"""The reordering service's domain: everything a request needs below the HTTP layer.

One subpackage per concern, imported in one direction (import-linter, pyproject.toml):

- ``batch``: work over a question file: the QA set format, calibrating a profile from a set of
  queries, and what the two command lines share.
- ``pipeline`` (a module): one request -> its strategy -> one result.
- ``context``: which scored passages go into the generator's prompt (token budget,
  distractors, near-duplicates, document order); beside the pipeline, read by ``app``.
- ``strategies``: every reordering method behind one port, by its wire name.
- ``learning``: ``auto``'s learner: the scoring model's position profile learned from the
  traffic it serves, its trust and its background runs.
- ``prompting``: (query, passages, order) -> token ids and spans; templates; answer rules.
- ``state``: what the service keeps (profiles, sampled runs, locks) on disk or in Redis.
- ``backends``: the scoring engines (transformers, vLLM, remote, the paced fake).
- ``model_assets``: finding and converting the packaged models.
- ``runtime``: the process's CPUs, the engine's measured rate, the fit's worker pool.
- ``config``: the one settings class and the strategies' names.
- ``errors``, ``passage`` (modules): the domain errors and the passage type every layer shares.
"""
