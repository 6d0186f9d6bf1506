"""``python -m app``: the same as the ``rag-reorder`` command."""

from app.cli import main

raise SystemExit(main())
