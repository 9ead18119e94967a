"""The root's LoRA adapters by served name: those of --lora-modules and those loaded at run time.

A request names an adapter by its model name; the root turns it into a LoRARequest (name, id,
path) that travels with the request's parameters, so every worker, including one restarted
after a crash, loads the adapter from its path when a request first needs it. That is why
nothing here talks to the workers: the registry is the truth, and it lives in the root, which
outlives every actor.

Unloading an adapter stops new requests from naming it; requests already admitted keep their
LoRARequest and finish with the adapter (a worker still has it loaded, or loads it again from
its path).

A client names the path of an adapter it loads at run time, so that path must lie in a
directory the operator allowed (`AdapterPaths`: lora.lora_path_allow; by default the
--lora-modules paths and the engine home), after following links; elsewhere the load is refused
without a word about the path (whether it exists, what it holds).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import msgspec

from engine.messages.params import LoRARequest, SamplingParams
from engine.model.config import ModelConfig
from engine.model.lora.files import AdapterError, check_adapter
from engine.request.outputs import EngineError
from engine.settings.lora_schema import LoraSettings, parse_lora_module


class AdapterForbidden(Exception):
    """An adapter path outside the allowed directories: refused without detail (403)."""


class AdapterPaths:
    """The directories run-time adapters may come from, at their real place (links followed)."""

    def __init__(self, roots: Iterable[str | Path]) -> None:
        self.roots = tuple(os.path.realpath(Path(root).expanduser()) for root in roots)

    def allows(self, path: str) -> bool:
        real = os.path.realpath(Path(path).expanduser())
        return any(os.path.commonpath([real, root]) == root for root in self.roots)


class AdapterRegistry:
    def __init__(
        self,
        base: ModelConfig,
        max_rank: int,
        reserved_names: Iterable[str],
        allowed: AdapterPaths | None = None,
    ) -> None:
        """`reserved_names`: the base model's served names, which no adapter may take;
        `allowed`: where run-time adapters may come from (None: anywhere, for the library)."""
        self.base = base
        self.max_rank = max_rank
        self.reserved = frozenset(reserved_names)
        self.allowed = allowed
        self.adapters: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}  # a --lora-modules base_model_name, by adapter name
        self._next_id = 1
        self._checked: set[tuple[str, str]] = set()  # (name, path) pairs known to fit

    def load(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` as `name` (`admit`, then `add`)."""
        return self.add(self.admit(name, path))

    def admit(self, name: str, path: str) -> LoRARequest:
        """The adapter at `path`, checked to be servable as `name`: AdapterForbidden outside
        the allowed directories, ValueError (AdapterError for the adapter itself) saying why
        otherwise. It reads the adapter's files: call it off the event loop, then `add`."""
        if not name or not path:
            raise ValueError("both 'lora_name' and 'lora_path' must be given")
        if self.allowed is not None and not self.allowed.allows(path):
            raise AdapterForbidden(name)
        self._check_name(name)
        return self.check(LoRARequest(name, 0, path))

    def add(self, request: LoRARequest) -> LoRARequest:
        """Serve an admitted adapter under its name, with an id of its own."""
        self._check_name(request.lora_name)
        served = LoRARequest(request.lora_name, self._next_id, request.lora_path)
        self._next_id += 1
        self.adapters[served.lora_name] = served
        return served

    def _check_name(self, name: str) -> None:
        if name in self.reserved:
            raise ValueError(f"'{name}' is the base model's name; choose another adapter name")
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")

    def unload(self, name: str) -> LoRARequest:
        """Stop serving `name`; KeyError when no adapter has that name."""
        request = self.adapters.pop(name, None)
        if request is None:
            raise KeyError(f"The lora adapter '{name}' cannot be found.")
        self.parents.pop(name, None)
        return request

    def get(self, model: str) -> LoRARequest | None:
        """The adapter a request's model name names; None: the base model (or no such name)."""
        return self.adapters.get(model)

    def names(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    def check(self, request: LoRARequest) -> LoRARequest:
        """`request` (an adapter a library caller names directly), once known to fit the base
        model; AdapterError otherwise."""
        key = (request.lora_name, request.lora_path)
        if key not in self._checked:
            if not request.lora_path:
                raise AdapterError(f"LoRA adapter '{request.lora_name}' has no lora_path")
            label = f"'{request.lora_name}'"
            check_adapter(request.lora_path, self.base, self.max_rank, label)
            self._checked.add(key)
        return request


def start_registry(
    settings: LoraSettings, base: ModelConfig, served_names: Iterable[str], home: Path
) -> AdapterRegistry | None:
    """The registry of an engine starting with `settings`, holding --lora-modules (checked
    already by the plan); None when LoRA is off. `home`: the engine home, where run-time
    adapters may come from unless lora.lora_path_allow says where."""
    if not settings.enable_lora:
        return None
    modules = [parse_lora_module(text) for text in settings.lora_modules]
    roots = settings.lora_path_allow or (*(module.path for module in modules), str(home))
    registry = AdapterRegistry(base, settings.max_lora_rank, served_names, AdapterPaths(roots))
    for module in modules:  # the operator's: wherever they are
        registry.add(registry.check(LoRARequest(module.name, 0, module.path)))
        if module.base_model_name:
            registry.parents[module.name] = module.base_model_name
    return registry


def with_adapter(
    params: SamplingParams, registry: AdapterRegistry | None, lora: LoRARequest | None
) -> SamplingParams:
    """`params` running with `lora` (a library caller's, checked here; None: as they are);
    EngineError (400) when LoRA is off or the adapter does not fit."""
    lora = lora or params.lora_request
    if lora is None:
        return params
    if registry is None:
        raise EngineError(
            "LoRA adapters are not enabled: start the engine with --enable-lora "
            "(LLM(..., enable_lora=True))",
            400,
            "lora_request",
        )
    try:
        registry.check(lora)
    except AdapterError as exc:
        raise EngineError(str(exc), 400, "lora_request") from None
    return msgspec.structs.replace(params, lora_request=lora)
