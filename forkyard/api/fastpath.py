"""Moved to :mod:`forkyard.relay.fastpath` (issue 20 step 2, "relay/"). The cluster gateway
still imports it from here until issue 19's gateway work has landed; then this file goes."""

from forkyard.relay.fastpath import *  # noqa: F401,F403
