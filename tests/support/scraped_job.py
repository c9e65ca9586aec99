"""The shared failover job of ``tests/metrics`` (its fixture is in ``tests/metrics/conftest.py``)."""

FAULT_ITER = 8
"""The iteration in which rank 1 is SIGKILLed."""
ITERS = 24
JOB, TOKEN = "scraped", "scraped-token-0123456789"
