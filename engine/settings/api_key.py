"""Where the API key comes from: the environment or a file, not the command line.

A process's command line is readable by every local user (/proc/<pid>/cmdline, `ps`), so a key
given as `--api-key KEY` is everyone's. ENGINE_API_KEY (the environment is readable by the
process's owner and root only) and `--api-key-file FILE` are the ways to pass one; the command
line still works, with a warning.
"""

from __future__ import annotations

import os
import stat
import sys

COMMAND_LINE_WARNING = (
    "warning: the API key given on the command line is readable by every local user "
    "(/proc/<pid>/cmdline, ps); pass it as ENGINE_API_KEY or --api-key-file FILE instead"
)


class ApiKeyFileError(ValueError):
    """The key file cannot be used; the message names it and why."""


def read_api_key_file(path: str) -> str:
    """The key in `path` (its first line, stripped), refused when empty, when the file is not a
    regular file, or when other users may write it; a warning when they may read it."""
    try:
        fd = os.open(os.path.expanduser(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ApiKeyFileError(f"cannot read the API key file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ApiKeyFileError(f"the API key file {path} is not a regular file")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ApiKeyFileError(f"the API key file {path} is writable by other users")
        if info.st_mode & (stat.S_IRGRP | stat.S_IROTH):
            warning = f"warning: the API key file {path} is readable by other users: chmod 600 it"
            print(warning, file=sys.stderr)
        try:
            first = file.read(64 * 1024).decode().splitlines()
        except UnicodeDecodeError:
            raise ApiKeyFileError(f"the API key file {path} is not UTF-8 text") from None
    key = first[0].strip() if first else ""
    if not key:
        raise ApiKeyFileError(f"the API key file {path} holds no key on its first line")
    return key
