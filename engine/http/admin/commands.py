"""The admin socket's commands as both ends know them: each command's arguments, so that the
client refuses a wrong command line before it connects (a usage error) and the server refuses
one that a raw client sends."""

from __future__ import annotations

# command → the names of its arguments
COMMANDS: dict[str, tuple[str, ...]] = {
    "health": (),
    "stats": (),
    "actors": (),
    "requests": (),
    "abort": ("ID",),
    "drain": (),
    "shutdown": (),
    "log-level": ("LEVEL",),
    "models": (),
    "load": ("MODEL",),
    "unload": ("MODEL",),
    "tenants": (),
    "reload-tenants": (),
}


def command_problem(cmd: str, args: list[str]) -> str | None:
    """What is wrong with this command line, or None."""
    wanted = COMMANDS.get(cmd)
    if wanted is None:
        return f"unknown command {cmd!r}; commands: {', '.join(COMMANDS)}"
    if len(args) != len(wanted):
        form = " ".join([cmd, *wanted])
        return f"{cmd} takes {len(wanted)} argument(s): {form}; got {len(args)}"
    return None
