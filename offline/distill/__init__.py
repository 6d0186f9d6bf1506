"""Preference distillation (the MoI paper, section 3.3.2 and appendix): a small scorer that keeps
the generator's preferences over passage orders.

``rag-reorder distill`` runs it in two steps:

1. ``preferences``: the teacher (the generator, through the serving pipeline, so its scores
   are exactly the serving scores) scores K random permutations of each training question's
   passages; the set is a resumable JSONL file.
2. ``train``: a LoRA adapter on the student is trained so that the softmax over K' sampled
   permutations of its query log-likelihoods matches the teacher's (KL divergence); it writes
   the adapter and a manifest (``service.model_assets.adapter``) that the service serves with
   ``RAG_REORDER_ADAPTER``.

``train`` is the one offline module that imports torch and peft (an import-linter contract);
this package's ``__init__`` imports neither, so ``preferences`` runs without them.
"""
