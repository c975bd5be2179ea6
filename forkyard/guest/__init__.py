"""What a sandbox's guest sees, whatever runtime runs it: the files forkyard writes into
it (:mod:`.files`: ``/etc/hosts``, the resolver list), the ``sudo`` broker it ships
(:mod:`.sudo`), and the host side of its agent, envd (:mod:`.envd`).

A layer of its own just above the ground (config, ids): the runtime, the network, the
orchestrator and template builds all use it, and it imports none of them.
"""
