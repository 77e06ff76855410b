"""Which extra a command needs when a package of its is not installed.

`pip install vllm-runbook` is the engine side only: the collector, with
prometheus-client, pydantic and nvidia-ml-py. The commands come with extras
(pyproject.toml): `service` for `runbook serve` and every other command,
`top` for `runbook top` (the service's packages and Textual), `plots` for
`runbook report`'s picture. A command run without its extra ends in one
line naming the extra to install, and exit 2 (`ExitCode.USAGE`), not in a
traceback.

Standard library only: `main` imports this before any command group, since
those import the service's packages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

# Import names of the packages each extra installs (and those they bring that
# our code imports directly: starlette with fastapi, rich with textual).
EXTRA_MODULES: Final[dict[str, frozenset[str]]] = {
    "service": frozenset(
        {
            "aiohttp",
            "alembic",
            "apscheduler",
            "fastapi",
            "httpx",
            "jinja2",
            "psutil",
            "sqlalchemy",
            "starlette",
            "uvicorn",
            "yaml",
            "yarl",
        }
    ),
    "top": frozenset({"textual", "rich"}),
    "plots": frozenset({"matplotlib"}),
}

# `runbook top` needs the service's packages too: its extra includes them.
COMMAND_EXTRA: Final[dict[str, str]] = {"top": "top"}


def missing_module(error: BaseException) -> str | None:
    """The package `error` says is not installed, if an extra installs it; None
    for anything else, a missing module of an installed package included (a
    bug keeps its traceback). Importing `a.b` without `a` names `a`."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return None
    name = error.name
    return name if any(name in modules for modules in EXTRA_MODULES.values()) else None


def command_of(argv: Sequence[str]) -> str | None:
    """The command `argv` names (its first word that is not an option), if any."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def needed_extra(error: BaseException, argv: Sequence[str]) -> str | None:
    """One line for the person, when `error` is a package of an extra that is not
    installed: which command needs which extra and how to install it."""
    module = missing_module(error)
    if module is None:
        return None
    command = command_of(argv)
    extra = next(e for e, modules in EXTRA_MODULES.items() if module in modules)
    if extra == "service" and command in COMMAND_EXTRA:
        extra = COMMAND_EXTRA[command]
    who = f"`runbook {command}`" if command else "the `runbook` command"
    return (
        f"{who} needs the {extra} extra: pip install 'vllm-runbook[{extra}]' "
        f"(no module named {module!r})"
    )
