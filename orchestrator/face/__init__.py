"""What users touch: the ``orch`` command (``cli/``), the HTTP API (``api``) and the web dashboard (``web/``).

May import: every other package of ``orchestrator``; nothing imports it.
"""
