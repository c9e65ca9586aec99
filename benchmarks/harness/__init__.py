"""Harnesses shared by the tests and the benchmarks; not part of the installed package.

- :mod:`.jobs`: the demo job's flags, the bundled corpus, the repository's paths.
- :mod:`.sandbox`: forks ranks of a tiny job from one warm parent (sandbox recording and replay).
- :mod:`.promotion`: a planned hand-over between forked ranks over a TCPStore, for the warm-up benchmark.
- :mod:`.member`: a stand-in member process to SIGKILL and SIGSTOP (detection tests and benchmark).
- :mod:`.nodes`: several launch agents of one job as loopback "nodes" and standby machines (multi-node
  tests, the node-loss downtime scenario).

Importable as ``harness`` with ``benchmarks/`` on the path (``pytest.ini`` sets it for the tests;
a benchmark run as a script has its own folder there already).
"""
