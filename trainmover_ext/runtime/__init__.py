"""TrainMover's in-process support: the standby's warm-up, identity, fault drills, memory probes.

- :mod:`.standby`: a process that warms up and waits to be promoted into a rank (the promotion
  itself is :mod:`trainmover_ext.migration.joiner`).
- :mod:`.identity`: who this process is in the job (member id, job space).
- :mod:`.faults`: ``--tm-inject-fault`` drills.
- :mod:`.memwatch`: peak resident memory over a window (the state transfer's report).
- :mod:`.quiet_build`: building a rank's model without collectives (a joiner's model build).
"""
