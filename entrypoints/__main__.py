"""``python -m entrypoints``: the same as the ``rag-reorder`` command."""

from entrypoints.cli import main

raise SystemExit(main())
