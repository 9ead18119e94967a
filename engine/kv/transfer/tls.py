"""Optional TLS for kv_transfer connections across hosts (kv_transfer.tls_cert, tls_key, tls_ca).

Both ends present a certificate of the deployment's CA and check the other's against it (mutual
TLS); host names are not checked, since the CA is the deployment's own and the HMAC handshake
inside the TLS channel proves the secret besides. What TLS adds: nobody on the network reads the
KV bytes (a prompt can be recovered from them) or changes them on the way.
"""

from __future__ import annotations

import ssl


class TlsFiles:
    """The three paths: all set (TLS) or none (plain TCP); ValueError naming one that is missing."""

    def __init__(self, cert: str, key: str, ca: str) -> None:
        given = {"tls_cert": cert, "tls_key": key, "tls_ca": ca}
        missing = [name for name, path in given.items() if not path]
        if missing and len(missing) < len(given):
            raise ValueError(
                f"kv_transfer.{missing[0]} must be set with "
                f"{', '.join(f'kv_transfer.{n}' for n in given if n not in missing)} "
                "(TLS needs a certificate, its key and the deployment's CA)"
            )
        self.cert, self.key, self.ca = cert, key, ca

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def server_context(self) -> ssl.SSLContext:
        return self._context(ssl.Purpose.CLIENT_AUTH)

    def client_context(self) -> ssl.SSLContext:
        return self._context(ssl.Purpose.SERVER_AUTH)

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(purpose, cafile=self.ca)
            context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"kv_transfer TLS files (cert {self.cert!r}, key {self.key!r}, CA {self.ca!r}) "
                f"cannot be loaded: {exc}"
            ) from None
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context
