"""Test support: the fake model runner, fault injection, tiny checkpoints and server helpers.

On pytest's `pythonpath` (see pyproject.toml), so tests import `support.<module>`.
"""
