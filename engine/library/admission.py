"""What `AsyncLLM.submit` does to a front end's EngineRequest before the registry takes it: its
KV-transfer directives read, the request policy applied in place (the model's defaults, the chat
template, every limit: EngineError naming the field in the API's words), a structured-output
constraint admitted, its LoRA adapter resolved, and the front end's words for the policy
dropped (no actor reads them)."""

from __future__ import annotations

from engine.inflight.kv_params import KvParams
from engine.lora.registry import AdapterRegistry, with_adapter
from engine.messages.requests import EngineRequest
from engine.request.grammar_admission import admit_constraint
from engine.request.outputs import EngineError
from engine.request.policy import RequestPolicy, renamed


async def admit(
    request: EngineRequest,
    policy: RequestPolicy,
    kv_params: KvParams,
    adapters: AdapterRegistry | None,
    waiting_samples: int,
) -> None:
    """Make `request` ready for the registry, in place; EngineError if it cannot run."""
    request.kv_handoff, request.kv_source = kv_params.directives(request.kv_transfer_params)
    request.kv_transfer_params = None  # read: its directives travel on
    one_token = request.kv_handoff == "hold"  # a prefill instance runs the prompt and one token
    policy.apply(request, waiting_samples=waiting_samples, one_token=one_token)
    if request.params.structured_outputs is not None:
        try:
            await admit_constraint(request.params.structured_outputs)
        except EngineError as error:
            raise renamed(error, request.field_names) from None
    request.params = with_adapter(request.params, adapters, None)
    request.defaulted_fields, request.field_names = frozenset(), {}
