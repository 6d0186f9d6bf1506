"""What only the offline commands run: never imported by the server (an import-linter contract).

``evaluation`` (``rag-reorder eval``: every strategy against the generator, with paired
statistics), ``positions`` (``rag-reorder calibrate-positions``: Cuconasu et al.'s measured
positional profiles) and ``distill`` (``rag-reorder distill`` and ``distill-eval``: paper
000's preference distillation of a smaller scorer, and its measurement). They drive the
serving pipeline (``service.pipeline``) like a client would; nothing on a request's path
imports them, so reading ``service/`` for what a request does never crosses them, and the
server never loads their libraries (matplotlib, ROUGE, tqdm; the distillation's training
imports torch and peft, as the transformers backend does).
"""
