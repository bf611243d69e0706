"""orch: cluster job orchestration for DeepSpeed ZeRO training."""

from importlib import import_module
from typing import Any, Callable

__version__ = "0.1.0"


def lazy_names(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` (PEP 562) that imports each of its names on first use.

    ``where`` maps a name to the submodule of ``package`` that defines it (``{"JobSpec": "jobspec"}``). A
    command that needs one small part of a package then does not load the rest (pydantic's models, the
    controller, prometheus_client: tenths of a second per ``orch`` call). The value is cached in the package.

    Raises:
        AttributeError: (from the returned function) ``package`` has no such name, as for any module.
    """
    def getattr_(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = import_module(f"{package}.{where[name]}")
        value = getattr(module, name)
        setattr(import_module(package), name, value)
        return value
    return getattr_
