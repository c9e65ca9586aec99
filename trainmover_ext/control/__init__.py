"""The control plane: membership with leases, a leader-elected controller, failure detection, the CLI.

Entry points for the launcher/agent:

- :class:`trainmover_ext.control.membership.Membership` - register a member, lease kept alive.
- :class:`trainmover_ext.control.controller.Controller` - election + watch + decide + execute.
- :func:`trainmover_ext.control.supervise.report_exit` - report a child's exit (fast path).
- :func:`trainmover_ext.control.membership.report_failure` - a rank reports a broken link (fast path).
- :class:`trainmover_ext.control.membership.PlanInbox` - learn of each migration plan.
- :mod:`trainmover_ext.control.fingerprint` - standby admission: a standby's model fingerprint
  against the one its job published.

Imported lazily by the CLI; this package imports nothing at load time.
"""
