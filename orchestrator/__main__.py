"""``python -m orchestrator ARGS`` is ``orch ARGS``."""

import sys

from orchestrator.face.cli import main

sys.exit(main())
