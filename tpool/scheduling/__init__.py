"""Scheduling on a host mirror of the pool's capacity: admission, reservations, preemption and
reconciliation decided on host integers, so a scheduler never waits for the device.

``HostMirror(table)`` wraps a :class:`tpool.PageTable`; see :mod:`tpool.scheduling.mirror` for
what it promises and :mod:`tpool.scheduling.snapshot` for reconciliation.
"""

from tpool.scheduling.mirror import HostMirror, WouldNotFit
from tpool.scheduling.mixed import MixedStep
from tpool.scheduling.snapshot import MirrorError, MirrorSnapshot

__all__ = ["HostMirror", "MixedStep", "WouldNotFit", "MirrorError", "MirrorSnapshot"]
