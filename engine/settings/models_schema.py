"""The [models] section of the settings schema (engine/settings/schema.py): which models one
server knows besides the one named by --model, and when each is loaded and unloaded
(engine/catalogue/)."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from engine.settings.durations import parse_keep_alive
from engine.settings.section import BYTES_UNIT, Section


class ModelsSettings(Section, frozen=True):
    dir: Annotated[
        str | None,
        Meta(
            description="a directory of models served on demand: each .gguf file and each "
            "Hugging Face checkpoint directory under it is a model named by its file or "
            "directory name (a models.toml there may give names, aliases and settings)"
        ),
    ] = None
    keep_alive: Annotated[
        str,
        Meta(
            min_length=1,
            description="how long a model loaded on demand stays loaded after its last request, "
            "as Ollama's keep_alive: a duration (30s, 5m, 1h30m, or seconds), 0 = unloaded "
            "after each answer, -1 = kept; a request's keep_alive overrides it",
        ),
    ] = "5m"
    max_loaded: Annotated[
        int,
        Meta(
            ge=1,
            description="most models loaded at once; loading one more first unloads the least "
            "recently used idle model (as Ollama's OLLAMA_MAX_LOADED_MODELS)",
        ),
    ] = 3
    memory: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="bytes the loaded models' weights and KV caches may take together; "
                "a load that would exceed it first unloads idle models, least recently used "
                "first, and each KV cache is sized from what the others leave; unset = the "
                "memory available at start",
                extra=BYTES_UNIT,
            ),
        ]
        | None
    ) = None
    max_waiting: Annotated[
        int,
        Meta(
            ge=1,
            description="requests that may wait for models being loaded; one more gets 503",
        ),
    ] = 64
    load_timeout: Annotated[
        float,
        Meta(
            gt=0.0,
            description="seconds a request waits for its model to be loaded (room made, "
            "actors started) before it is refused with 503",
        ),
    ] = 600.0


def models_problems(models: ModelsSettings) -> list[tuple[str, str]]:
    """The [models] section's rules, as (setting, what is wrong)."""
    try:
        parse_keep_alive(models.keep_alive)
    except ValueError as exc:
        return [("models.keep_alive", str(exc))]
    return []
