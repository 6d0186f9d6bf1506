"""The prompt's context, not just its order (issue 93): which passages to keep within the
generator's token budget, which to drop as distractors or near-duplicates, and the order they
go in (the fit's placement, or each source's document order). Only ``app`` imports it; it reads
the pipeline's result through plain arrays, so it sits beside the pipeline, not above it.
"""
