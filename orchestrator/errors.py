"""One exception tree for everything orch reports to a user.

Every error a user can cause (a bad hostfile, a bad filter, a bad spec, a port in use)
is an :class:`OrchError`. Its message is a whole sentence that names the file, line,
field or token at fault and what was expected, so the CLI can print ``str(err)`` and
exit non-zero without a traceback. Failures of training itself (a rank exiting, a node
lost) are *data* recorded on the attempt, not exceptions.
"""

from __future__ import annotations

__all__ = [
    "OrchError",
    "HostfileError",
    "FilterError",
    "SpecError",
    "ConfigError",
    "PlanError",
    "LaunchError",
    "StateError",
    "StoreFullError",
    "NotFoundError",
    "ProvisionError",
    "CheckpointError",
    "ExportError",
]


class OrchError(Exception):
    """Base class of every error orch shows to a user as a message (never a traceback)."""

    exit_code = 2


class HostfileError(OrchError):
    """A hostfile is missing, unreadable or has a line not of the form ``<host> slots=<n>``.

    Attributes:
        path: the hostfile's path (or ``"<hostfile>"`` for text given inline).
        line_no: 1-based line number of the bad line, or ``None`` for whole-file problems.
        line: the text of the bad line (stripped), or ``None``.
    """

    def __init__(self, message: str, *, path: str = "<hostfile>", line_no: int | None = None,
                 line: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.line_no = line_no
        self.line = line


class FilterError(OrchError):
    """An ``include``/``exclude`` filter string, or ``num_nodes``/``num_gpus``, is invalid.

    Attributes:
        token: the offending ``NODE_SPEC`` token (or the whole string), if any.
    """

    def __init__(self, message: str, *, token: str | None = None) -> None:
        super().__init__(message)
        self.token = token


class SpecError(OrchError):
    """A job spec failed validation.

    Attributes:
        path: the spec file's path, if it came from a file.
        problems: every problem found, as ``(field_path, message)`` pairs, e.g.
            ``("launcher", "expected one of pdsh, standard, nossh; got 'foo'")``.
    """

    def __init__(self, message: str, *, path: str | None = None,
                 problems: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.problems = list(problems or [])


class ConfigError(SpecError):
    """An Accelerate config or a DeepSpeed config cannot be used (orchestrator.spec.accelerate,
    orchestrator.spec.dsconfig); ``problems`` holds one ``(key path, message with the fix)`` per problem."""


class PlanError(OrchError):
    """A valid spec cannot be planned (e.g. a port in use, no ranks left after filtering)."""


class LaunchError(OrchError):
    """A launcher was asked for something it cannot express (e.g. an unknown launcher name)."""


class StateError(OrchError):
    """An illegal job or attempt state transition was requested (see orchestrator.store.states)."""


class StoreFullError(OrchError):
    """The state database cannot be written: its disk is full (or fails). Reads still work; nothing
    that was recorded is lost, and what could not be recorded is retried (docs/recovery.md)."""


class NotFoundError(OrchError):
    """A job (or attempt, or rank) named by the user does not exist."""


class ProvisionError(OrchError):
    """Agents could not be started on one or more nodes; the message names each node and why.

    ``reason`` is the same finding without the node's name, so that nodes that failed alike are
    reported together (it defaults to the message)."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


class CheckpointError(OrchError):
    """No checkpoint to resume from where one was expected, or one could not be converted
    (e.g. to DeepSpeed's universal format); the message names the directory and why."""


class ExportError(CheckpointError):
    """A checkpoint cannot be exported as a consolidated state dict (orchestrator.checkpoints.export): no
    complete tag, a tag DeepSpeed cannot read, or an output file that cannot be written."""
