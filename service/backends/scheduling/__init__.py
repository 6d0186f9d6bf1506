"""How prompts share an engine's forwards: batch planning under token and row budgets, and the
cross-request scheduler."""
