"""The [lora] section of the settings schema: LoRA adapters served beside the base model, as
vLLM's --enable-lora, --lora-modules, --max-loras and --max-lora-rank."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from engine.settings.section import Section


class LoraModule(msgspec.Struct, frozen=True):
    """One adapter given at start: `name=path`, or vLLM's JSON form."""

    name: str
    path: str
    base_model_name: str | None = None


class LoraSettings(Section, frozen=True):
    enable_lora: Annotated[
        bool,
        Meta(
            description="serve LoRA adapters (PEFT format), chosen per request by model name; "
            "one rank, not with P/D disaggregation"
        ),
    ] = False
    lora_modules: Annotated[
        tuple[str, ...],
        Meta(
            description="adapters loaded at start: name=path, or vLLM's JSON "
            '{"name": ..., "path": ..., "base_model_name": ...}; more load at run time '
            "(POST /v1/load_lora_adapter)"
        ),
    ] = ()
    lora_path_allow: Annotated[
        tuple[str, ...],
        Meta(
            description="directories adapters loaded at run time may come from (any depth, "
            "links followed to their real place; elsewhere: 403); unset = the --lora-modules "
            "paths and the engine home"
        ),
    ] = ()
    max_loras: Annotated[
        int, Meta(ge=1, le=1024, description="distinct adapters in one batch (step)")
    ] = 1
    max_lora_rank: Annotated[
        int, Meta(ge=1, le=1024, description="largest adapter rank (r) accepted")
    ] = 16
    max_cpu_loras: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="adapters a worker keeps loaded (least recently used dropped); "
                "unset = max_loras",
            ),
        ]
        | None
    ) = None

    def cache_size(self) -> int:
        """How many adapters a worker keeps loaded: never fewer than one step may use."""
        return max(self.max_cpu_loras or 0, self.max_loras)


def parse_lora_module(text: str) -> LoraModule:
    """`name=path` or a JSON object with name and path; ValueError saying what is wrong."""
    text = text.strip()
    if text.startswith("{"):
        try:
            module = msgspec.json.decode(text, type=LoraModule)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{text!r} is not a valid LoRA module ({exc})") from None
    else:
        name, has_path, path = text.partition("=")
        module = LoraModule(name.strip(), path.strip())
        if not has_path:
            raise ValueError(f"{text!r} is not name=path")
    if not module.name or not module.path:
        raise ValueError(f"{text!r} needs a name and a path")
    return module


def lora_problems(settings: object) -> list[tuple[str, str]]:
    """Invalid combinations, as (the setting at fault, what is wrong with it)."""
    lora: LoraSettings = settings.lora  # type: ignore[attr-defined]
    if not lora.enable_lora:
        if lora.lora_modules:
            return [("lora.lora_modules", "needs lora.enable_lora (--enable-lora)")]
        return []
    problems = []
    parallel = settings.parallel  # type: ignore[attr-defined]
    if parallel.tensor_parallel_size != 1:
        problems.append(
            (
                "lora.enable_lora",
                f"LoRA adapters are not supported with tensor parallelism (tensor_parallel_size "
                f"{parallel.tensor_parallel_size}); use 1",
            )
        )
    kv = settings.kv_transfer  # type: ignore[attr-defined]
    if kv.role != "both" or kv.prefill_replicas or kv.decode_replicas:
        problems.append(
            (
                "lora.enable_lora",
                "LoRA adapters are not supported with P/D disaggregation (KV handed between "
                "instances carries no adapter)",
            )
        )
    names: set[str] = set()
    for text in lora.lora_modules:
        try:
            module = parse_lora_module(text)
        except ValueError as exc:
            problems.append(("lora.lora_modules", str(exc)))
            continue
        if module.name in names:
            problems.append(("lora.lora_modules", f"names adapter {module.name!r} twice"))
        names.add(module.name)
    return problems
