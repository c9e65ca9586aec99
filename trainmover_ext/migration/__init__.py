"""The worker side of a migration, read top-down after :mod:`trainmover_ext.control`.

The control plane decides (``control/decide.py``: a plan per failure or request, and
the convergence record per failure epoch); this package carries the decisions out
inside each process:

1. :mod:`.worker`: :class:`~.worker.WorkerRuntime`, the training loop's hooks under
   ``--trainmover``: it registers the rank, watches plans (a failure plan abandons the
   communicator at once), and runs recovery as a loop that restarts at the newest
   epoch whenever a newer plan cuts an attempt short.
2. :mod:`.recovery`: one attempt at a failure epoch: rewind, report what the rank
   holds, rebuild links, carry out the convergence record (state copies or the
   checkpoint).
3. :mod:`.joiner`: a promoted standby joins as the plan's rank, builds its model while
   its links come up, and takes its state.
4. :mod:`.planned`: a planned move's hand-over from the leaver to the joiner.
5. :mod:`.transfer`: streaming one rank's training state to another.
6. :mod:`.timeline`: per-step timestamps written into the plan.
7. :mod:`.standby`: a standby's life: warm up (the sandbox), wait for a plan that names it,
   then become the rank through :mod:`.joiner`.
"""
