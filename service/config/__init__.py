"""Configuration: the one pydantic-settings class (``settings``) and the strategies' names.

Imports nothing of the service but itself: every other subpackage may read the settings.
"""
