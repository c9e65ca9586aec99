"""``trainmover simulate``: project ETTR and wasted GPU-hours at 1K-128K GPUs.

The package is pure Python (numpy for the random streams, matplotlib only for
``--plot``). Nothing here touches a process group, a store or a GPU, so it runs
anywhere and its tests are fast.

Modules:
    config       the typed :class:`SimConfig` (every flag of the subcommand)
    events       seeded interruption streams (unexpected, planned) and the rebalance timer
    strategies   downtime models per recovery strategy, and measured-downtime loading
    engine       the event-driven simulation and the standby-count optimisation
    paper        the paper's published figures and the side-by-side comparison
    report       table, JSON and plot
    scale_check  membership-scale check: what one migration touches at 1,000+ ranks
    cli          ``add_parser`` / ``run`` for the ``trainmover`` dispatcher
"""
