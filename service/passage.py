"""The passage a caller hands over: the one data type every layer of a request shares."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Passage:
    """One retrieved passage as the caller hands it over.

    ``id`` and ``score`` (the retriever's) are carried for the response and for strategies that
    use the retriever prior; only ``title`` and ``text`` reach the prompt. ``source`` and
    ``offset`` (the document it was cut from, and where) only order the context
    (``service.context``, document order).
    """

    text: str
    title: str | None = None
    id: str | None = None
    score: float | None = None
    source: str | None = None
    offset: int | None = None
