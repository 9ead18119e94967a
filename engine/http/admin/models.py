"""The admin socket's view of the models: `models` (each model's state), `load MODEL`,
`unload MODEL`, and the per-model parts of `stats`, `actors` and `requests`."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.http.model_routes import model_cards
from engine.http.state import ServerState
from engine.messages.admin import EngineStats
from engine.request.outputs import EngineError


class AdminError(Exception):
    pass


def model_stats(state: ServerState) -> EngineStats:
    """The default model's figures (the first loaded model's while it is not loaded); `models`
    shows every model's state."""
    loaded = dict(state.models.loaded())
    served = loaded.get(state.model_name) or next(iter(loaded.values()), None)
    if served is None:
        raise AdminError("no model is loaded (see the models command)")
    return served.llm.stats()


def every_models_rows(state: ServerState, cmd: str) -> list[Any]:
    """`actors` or `requests` of every loaded model, each row naming its model."""
    rows: list[Any] = []
    for name, served in state.models.loaded():
        found = served.llm.actors() if cmd == "actors" else served.llm.requests()
        rows += [msgspec.structs.replace(row, model=name) for row in found]
    return rows


async def manage_models(state: ServerState, cmd: str, args: list[str]) -> Any:
    try:
        if cmd == "load":
            await state.models.load(args[0])
        elif cmd == "unload":
            await state.models.unload(args[0])
    except EngineError as e:
        raise AdminError(e.message) from None
    cards = model_cards(state)
    if args:
        canonical = state.models.canonical(args[0])
        cards = [card for card in cards if card.id == canonical]
    return [msgspec.to_builtins(card) for card in cards]
