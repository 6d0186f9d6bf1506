"""Helpers shared by tests: tiny real-architecture models, cache locations."""
