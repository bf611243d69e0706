"""What resolving a DeepSpeed config reads from the job's other files: the model's hidden size
(``model_config``) and who fills the config's ``"auto"`` values (the entrypoint's source).

Who fills them is the spec's ``deepspeed_config_filled_by``: ``orch``, ``script``, or ``auto``:
detected from the entrypoint script's own source (parsed, never run), by :func:`script_library`:

* the HF Trainer (``"transformers"``): the script imports a ``...Trainer`` or ``...TrainingArguments``
  from ``transformers`` (or ``trl``, whose trainers are ``transformers.Trainer``\\ s), or uses
  ``transformers.Trainer`` ..., or imports ``transformers`` and is given ``--deepspeed FILE``
  (``TrainingArguments``' flag, the way Hugging Face's example scripts take it);
* Accelerate (``"accelerate"``): it imports ``accelerate.Accelerator`` (or uses it);
* otherwise orch fills them, as it does for a module (``module: true``) or a program
  (``no_python: true``), which are not read.
"""

from __future__ import annotations

import ast
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..errors import ConfigError

__all__ = ["Filler", "who_fills", "script_library", "has_auto", "hidden_size_from_model_config"]

_HF_PACKAGES = ("transformers", "trl")


@dataclass(frozen=True)
class Filler:
    """Who fills the ``"auto"`` values of a job's DeepSpeed config, and why.

    Attributes:
        filled_by: ``"orch"`` or ``"script"``.
        library: what in the script fills them: ``"transformers"`` (the HF Trainer) or
            ``"accelerate"``; None where not detected (orch, or ``script`` given in the spec).
        why: for ``orch plan``, e.g. ``detected: hf_trainer.py imports transformers.Trainer``.
    """

    filled_by: str
    library: str | None
    why: str


def who_fills(choice: str, entrypoint: str, *, module: bool = False, no_python: bool = False,
              args: Sequence[str] = ()) -> Filler:
    """The spec's ``deepspeed_config_filled_by``, with ``"auto"`` detected from the entrypoint.

    Args:
        choice: ``"auto"``, ``"orch"`` or ``"script"``.
        entrypoint: the spec's entrypoint (an absolute script path unless module/no_python).
        module, no_python: the spec's: such an entrypoint is not read (orch fills).
        args: the script's arguments (``--deepspeed FILE`` is the HF Trainer's flag).

    Returns:
        The :class:`Filler`; never raises (an unreadable script is "orch", and says so).
    """
    if choice in ("orch", "script"):
        return Filler(choice, None, f"deepspeed_config_filled_by: {choice} in the job spec")
    if module or no_python:
        what = "a module (module: true)" if module else "not a Python script (no_python: true)"
        return Filler("orch", None, f"not detected: the entrypoint is {what}, which orch does not read; set "
                                    "deepspeed_config_filled_by: script if it fills them")
    library, why = script_library(entrypoint, args)
    return Filler("script" if library else "orch", library, why)


def script_library(path: str, args: Sequence[str] = ()) -> tuple[str | None, str]:
    """What in a Python script fills a DeepSpeed config's "auto" values, read from its source.

    Rule (see the module's docstring): the HF Trainer before Accelerate (it runs on Accelerate).

    Args:
        path: the script.
        args: its arguments.

    Returns:
        ``("transformers" | "accelerate" | None, "detected: <file> imports ...")``; None (with
        the reason) also where the file cannot be read or parsed.
    """
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except OSError as err:
        return None, f"not detected: cannot read {path}: {err.strerror}"
    except (SyntaxError, ValueError) as err:
        return None, f"not detected: {name} does not parse as Python ({err})"
    found = sorted(_uses(tree))
    hf = [what for _, lib, what in found if lib == "transformers"]
    if not hf and _given_deepspeed_file(args) and _imports(tree, _HF_PACKAGES):
        hf = ["imports transformers and is given --deepspeed FILE (TrainingArguments' flag)"]
    if hf:
        return "transformers", f"detected: {name} {hf[0]}"
    acc = [what for _, lib, what in found if lib == "accelerate"]
    if acc:
        return "accelerate", f"detected: {name} {acc[0]}"
    return None, (f"detected: {name} imports neither transformers' Trainer/TrainingArguments nor "
                  "accelerate's Accelerator")


def _is_trainer(name: str) -> bool:
    return name.endswith(("Trainer", "TrainingArguments"))


def _uses(tree: ast.AST) -> Iterable[tuple[int, str, str]]:
    """``(line, library, what)`` for each import or use of a Trainer / TrainingArguments / Accelerator."""
    aliases: dict[str, str] = {}  # import transformers as tf: tf -> transformers
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            root = node.module.split(".")[0]
            for alias in node.names:
                if root in _HF_PACKAGES and _is_trainer(alias.name):
                    yield node.lineno, "transformers", f"imports {node.module}.{alias.name}"
                elif root == "accelerate" and alias.name == "Accelerator":
                    yield node.lineno, "accelerate", f"imports {node.module}.Accelerator"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root in (*_HF_PACKAGES, "accelerate") and (alias.asname is None or alias.name == root):
                    aliases[alias.asname or root] = root
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            root = aliases[node.value.id]
            if root in _HF_PACKAGES and _is_trainer(node.attr):
                yield node.lineno, "transformers", f"uses {root}.{node.attr}"
            elif root == "accelerate" and node.attr == "Accelerator":
                yield node.lineno, "accelerate", "uses accelerate.Accelerator"


def _imports(tree: ast.AST, packages: tuple[str, ...]) -> bool:
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        if any(n.split(".")[0] in packages for n in names):
            return True
    return False


def _given_deepspeed_file(args: Sequence[str]) -> bool:
    """``--deepspeed FILE`` or ``--deepspeed=FILE`` (DeepSpeed's own ``--deepspeed`` is a bare flag)."""
    return any(a.startswith("--deepspeed=") or (a == "--deepspeed" and i + 1 < len(args)
                                                   and not args[i + 1].startswith("-"))
               for i, a in enumerate(args))


def has_auto(config: Mapping[str, Any]) -> bool:
    """Whether any value of ``config`` (at any depth of mappings; lists are values) is ``"auto"``."""
    return any(has_auto(v) if isinstance(v, Mapping) else v == "auto" for v in config.values())


def hidden_size_from_model_config(path: str | os.PathLike) -> int:
    """The hidden size of a Hugging Face model config, as Accelerate reads it.

    Source: ``Accelerator._prepare_deepspeed``: ``model.config.hidden_size``, else
    ``max(model.config.hidden_sizes)``.

    Args:
        path: a ``config.json`` file, or a directory holding one (a model's folder).

    Returns:
        The hidden size (an int > 0).

    Raises:
        ConfigError: the file is missing or not JSON, or has neither key (or a bad value).
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise ConfigError(f"model_config {p}: cannot read it: {err.strerror}.", path=p) from err
    except json.JSONDecodeError as err:
        raise ConfigError(f"model_config {p} is not valid JSON: {err.msg} at line {err.lineno}.", path=p) from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"model_config {p} is not UTF-8 text (bad byte at offset {err.start}); expected a "
                          "JSON file.", path=p) from err
    value: Any = None
    if isinstance(data, dict):
        if "hidden_size" in data:
            value = data["hidden_size"]
        elif isinstance(data.get("hidden_sizes"), list) and data["hidden_sizes"]:
            value = max(data["hidden_sizes"])
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"model_config {p} has neither a positive hidden_size nor hidden_sizes (got {value!r}); "
                          "set hidden_size in the job spec instead.", path=p)
    return value
