"""In-process helpers every TrainMover process uses, below the migration path.

- :mod:`.faults`: ``--tm-inject-fault`` drills.
- :mod:`.memwatch`: peak resident memory over a window (the state transfer's report).
- :mod:`.quiet_build`: building a rank's model without collectives (a joiner's model build).

A standby's life is :mod:`trainmover_ext.migration.standby`, a process's identity in its job
:mod:`trainmover_ext.launch.identity`, and the standby admission check
:mod:`trainmover_ext.control.fingerprint`.
"""
