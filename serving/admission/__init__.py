"""Admission."""
