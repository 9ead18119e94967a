"""The deployment secret: what every kv_transfer connection proves (handshake.py) and what signs
the kv_transfer_params a prefill instance hands out (signing.py).

Where it comes from, first match:
- one-launch P/D (`--prefill-replicas`/`--decode-replicas`): a random secret made once per root
  process; nobody outside the run needs it, so nobody is told it;
- `ENGINE_KV_SECRET` (the value itself) or `kv_transfer.secret_file` (a file holding it), never
  both: never a command-line value, which any user of the host may read in `ps`;
- neither: `<engine home>/kv_transfer.secret`, created owner-only with 256 random bits when
  missing (as Erlang's ~/.erlang.cookie): the instances of one user on one host then share it
  with no setup; another host needs a copy of the file, or the same ENGINE_KV_SECRET.

The secret's value is never logged, put in a settings dump, or passed on a command line.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from engine.settings import Settings
from engine.settings.home import check_home_path
from engine.settings.loading import resolve_home

log = logging.getLogger(__name__)

SECRET_ENV = "ENGINE_KV_SECRET"
SECRET_FILE_NAME = "kv_transfer.secret"
MIN_SECRET_BYTES = 16  # 128 bits of a random secret; a passphrase should be longer

_RUN_SECRET = secrets.token_bytes(32)  # one-launch P/D: this root process's, never written


class SecretError(ValueError):
    """No usable deployment secret; the message names the setting and what was wrong."""


def instance_secret(settings: Settings, environ: Mapping[str, str] = os.environ) -> bytes:
    """The secret of an instance with these settings (one that moves KV)."""
    kv = settings.kv_transfer
    return deployment_secret(
        one_launch=bool(kv.prefill_replicas and kv.decode_replicas),
        secret_file=kv.secret_file,
        home=resolve_home(settings),
        environ=environ,
    )


def deployment_secret(
    *, one_launch: bool, secret_file: str | None, home: Path, environ: Mapping[str, str]
) -> bytes:
    if one_launch:
        return _RUN_SECRET
    given = environ.get(SECRET_ENV)
    if given is not None and secret_file:
        raise SecretError(
            f"both {SECRET_ENV} and kv_transfer.secret_file are set: give the deployment secret "
            "one way"
        )
    if given is not None:
        return _checked(given.strip().encode(), SECRET_ENV)
    if secret_file:
        return read_secret_file(Path(secret_file).expanduser(), "kv_transfer.secret_file")
    return ensure_secret_file(home / SECRET_FILE_NAME)


def read_secret_file(path: Path, what: str) -> bytes:
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as exc:
        raise SecretError(f"{what}: cannot read {str(path)!r}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s %s is readable by other users than its owner: chmod 600 it", what, path)
    return _checked(data.strip(), f"{what} {str(path)!r}")


def ensure_secret_file(path: Path) -> bytes:
    """The secret in `path`, created first (atomically: two instances starting together agree)
    when there is none."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_hex(32) + "\n")
        try:
            os.link(draft, path)  # fails if another instance made it meanwhile: theirs wins
            log.info(
                "created the KV transfer deployment secret %s (copy it to the hosts of "
                "the other instances, or set %s on each)",
                path,
                SECRET_ENV,
            )
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    try:  # a secret another user could have written would be theirs to sign with
        check_home_path(path, path.parent)
    except OSError as exc:
        raise SecretError(f"the KV transfer secret file: {exc}") from None
    return read_secret_file(path, "the KV transfer secret file")


def _checked(secret: bytes, what: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(
            f"{what} holds {len(secret)} bytes; a deployment secret takes at least "
            f"{MIN_SECRET_BYTES} (make one with `openssl rand -hex 32`)"
        )
    return secret
