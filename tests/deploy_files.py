"""The Dockerfile as the tests read it: the final image's ENV, ENTRYPOINT and CMD. Docker cannot
run here, so the tests run what the image would run, with the environment it would set."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) of the Dockerfile, continuation lines joined, comments left out."""
    lines = [
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")
    ]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    found = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def image_env() -> dict[str, str]:
    """The final stage's ENV: what every container of the image starts with."""
    env: dict[str, str] = {}
    for word, rest in final_stage():
        if word == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(rest))
    return env


def image_command() -> tuple[list[str], list[str]]:
    """The image's ENTRYPOINT and CMD, in exec form (JSON), the only form in which a signal
    to the container reaches the program rather than a shell."""
    found = dict(final_stage())
    return json.loads(found["ENTRYPOINT"]), json.loads(found["CMD"])
