"""gVisor (runsc) runtime driver; see :mod:`forkyard.runtime.gvisor.driver`."""

from forkyard.runtime.gvisor.driver import GVisorDriver

__all__ = ["GVisorDriver"]
