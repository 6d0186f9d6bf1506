"""Engines with no model, part of the backend contract: the deterministic fake with a known
truth, and the paced benchmark engine that takes a measured GPU's time."""
