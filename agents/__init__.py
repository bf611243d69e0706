"""orch node agents: start, supervise and report the ranks of one node."""
