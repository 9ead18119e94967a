"""Files in shared places (/dev/shm, /tmp, the engine home): made exclusively, checked before use.

Every local user may create names in /dev/shm and /tmp, and may list them. So a run creates
what it keeps there with O_CREAT | O_EXCL | O_NOFOLLOW, inside a directory of its own (mode
0700) wherever it can: a name that someone else took first, as a file or as a link, is never
opened. What a run opens there is checked on the open descriptor (fstat, so nothing can be
swapped between the check and the use): reached without following a link, a regular file (or a
directory, or a FIFO, where that is what is wanted), owned by this process's uid, with no
permission bit for group or others. A failure is one line naming the path, its owner and what
is wrong.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat

_KINDS = {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO"}


class ForeignFileError(PermissionError):
    """A path in a shared place is not what this run made: its message names path and owner."""


class TakenNameError(FileExistsError):
    """A name this run wanted to create exists already; the message names its owner."""


def owner_of(uid: int) -> str:
    """`name (uid N)`, or `uid N` for a uid without a passwd entry."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def path_owner(path: str) -> str:
    """The owner of `path` itself (a link's own owner), in words; "nobody" if it is gone."""
    try:
        return owner_of(os.lstat(path).st_uid)
    except OSError:
        return "nobody (it is gone)"


def taken(path: str) -> TakenNameError:
    return TakenNameError(
        f"{path} exists already, owned by {path_owner(path)}: a name this run creates must be "
        "new (remove it if it is a leftover, or find who made it)"
    )


def check_private(info: os.stat_result, path: str, kind: int = stat.S_IFREG) -> None:
    """ForeignFileError unless `info` is a `kind` owned by us with no group/other permission."""
    found = stat.S_IFMT(info.st_mode)
    mode = stat.S_IMODE(info.st_mode)
    wrong = []
    if found != kind:
        wrong.append(f"not {_KINDS.get(kind, oct(kind))}")
    if info.st_uid != os.getuid():
        wrong.append(f"owned by {owner_of(info.st_uid)}, not by this run's uid {os.getuid()}")
    if mode & 0o077:
        wanted = "0700" if kind == stat.S_IFDIR else "0600"
        wrong.append(f"mode {mode:04o} lets other users in (expected {wanted})")
    if wrong:
        raise ForeignFileError(f"refusing {path}: {'; '.join(wrong)}")


def open_private(
    path: str, flags: int = os.O_RDONLY, kind: int = stat.S_IFREG, dir_fd: int | None = None
) -> int:
    """Open `path` (never through a link, never blocking on a FIFO; relative to `dir_fd` when
    given) and check it: a descriptor, or ForeignFileError (FileNotFoundError when missing)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise ForeignFileError(
                f"refusing {path}: a symbolic link (owned by {path_owner(path)})"
            ) from None
        raise
    try:
        check_private(os.fstat(fd), path, kind)
    except BaseException:
        os.close(fd)
        raise
    if kind == stat.S_IFREG:  # O_NONBLOCK was only for the open of a FIFO planted here
        os.set_blocking(fd, True)
    return fd


def create_private(path: str, flags: int = os.O_RDWR) -> int:
    """Create `path` exclusively (mode 0600) and return its descriptor; TakenNameError names
    the owner of a name that exists already (a file, a link, anything)."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise taken(path) from None
    os.fchmod(fd, 0o600)  # whatever the umask
    return fd


def make_private_dir(path: str) -> None:
    """Create the directory `path` (mode 0700) exclusively; TakenNameError if it exists."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        raise taken(path) from None
    os.chmod(path, 0o700)


def ensure_private_dir(path: str) -> None:
    """`path` as a directory of ours with mode 0700: created if missing (with its parents),
    else checked; ForeignFileError names what is wrong with one that exists."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    try:
        make_private_dir(path)
    except TakenNameError:
        check_private(os.lstat(path), path, stat.S_IFDIR)


def check_owned_tree(path: str) -> None:
    """ForeignFileError unless `path` (followed, as users link their homes) is a directory of
    ours that group and others cannot write: for the engine home, where libraries it loads and
    checkpoints it reads live."""
    info = os.stat(path)
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISDIR(info.st_mode):
        raise ForeignFileError(f"refusing {path}: not a directory")
    if info.st_uid != os.getuid() or mode & 0o022:
        raise ForeignFileError(
            f"refusing {path}: owned by {owner_of(info.st_uid)} with mode {mode:04o}; it must "
            f"belong to uid {os.getuid()} and be writable by it alone (chmod go-w)"
        )
