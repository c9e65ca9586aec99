"""Helpers for integration tests: real member processes that can be SIGKILLed and SIGSTOPped."""

from harness.member import reap, spawn_member

__all__ = ["reap", "spawn_member"]
