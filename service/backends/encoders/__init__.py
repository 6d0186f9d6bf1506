"""Sentence encoders for the rankers that need no language model (``dense``)."""
