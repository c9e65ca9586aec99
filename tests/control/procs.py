"""Helpers for integration tests: real member processes that can be SIGKILLed and SIGSTOPped."""

from trainmover_ext.control.member_main import reap, spawn_member

__all__ = ["reap", "spawn_member"]
