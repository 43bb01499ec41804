"""Scheduling on a host mirror of the pool's capacity: admission, reservations, preemption and
reconciliation decided on host integers, so a scheduler never waits for the device.

``HostMirror(table)`` wraps a :class:`tpool.PageTable`; see :mod:`tpool.scheduling.mirror` for
what it promises and :mod:`tpool.scheduling.snapshot` for reconciliation; ``PrefixCache(mirror)``
keeps finished requests' whole pages and revives them for requests that start with the same tokens.
"""

from tpool.scheduling.mirror import HostMirror, WouldNotFit
from tpool.scheduling.mixed import MixedStep
from tpool.scheduling.prefix_cache import PrefixCache, PrefixMatch
from tpool.scheduling.snapshot import MirrorError, MirrorSnapshot

__all__ = ["HostMirror", "MixedStep", "PrefixCache", "PrefixMatch", "WouldNotFit", "MirrorError", "MirrorSnapshot"]
