"""The image's HEALTHCHECK: exit 0 when the engine's /health answers 200, else 1 and one line.

/health is the liveness answer: 200 while the engine serves, heals an actor or drains; 503 only
once it has given up. Kubernetes ignores HEALTHCHECK and probes /health and /ready itself
(deploy/kubernetes/); this is for `docker run` and Compose.

The URL is ENGINE_HEALTHCHECK_URL, else the server's own address from the settings variables
the image sets (ENGINE_SERVER__HOST, ENGINE_SERVER__PORT), with a wildcard host read as
loopback. Only the standard library: it runs every few seconds and must start fast.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping

TIMEOUT_S = 4.0
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def health_url(environ: Mapping[str, str]) -> str:
    if environ.get("ENGINE_HEALTHCHECK_URL"):
        return environ["ENGINE_HEALTHCHECK_URL"]
    host = environ.get("ENGINE_SERVER__HOST", "127.0.0.1").strip()
    host = WILDCARDS.get(host, host)
    port = environ.get("ENGINE_SERVER__PORT", "8000").strip()
    return f"http://[{host}]:{port}/health" if ":" in host else f"http://{host}:{port}/health"


def main() -> int:
    url = health_url(os.environ)
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"engine healthcheck: {url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"engine healthcheck: {url} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
