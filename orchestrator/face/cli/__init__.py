"""The ``orch`` command: one module per command group, the parser and ``main`` in :mod:`.app`.

May import: every other package of ``orchestrator`` and ``orchestrator.face.api`` (``orch server``).
"""

from .app import main

__all__ = ["main"]
