"""TrainMover's in-process runtime: the worker hooks, the standby, state transfer.

- :mod:`.worker`: :class:`WorkerRuntime`, the training loop's hooks under ``--trainmover``
  (membership, abandon on a failure plan, convergence, planned hand-over).
- :mod:`.standby`: a process that warms up and waits to be promoted into a rank.
- :mod:`.converge`: the pure decision of the resume iteration and who copies state to whom.
- :mod:`.transfer`: streaming one rank's training state to another over a temporary link.
"""
