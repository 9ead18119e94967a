"""A request's constraint checked against the grammar library before it is admitted, off the
root's event loop: building a large grammar takes the library up to seconds, during which the
loop must keep serving everyone else.

Two threads of their own: a client sending many large constraints waits for them, and takes
neither the loop nor the default executor's threads from the rest.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from engine.messages.params import StructuredOutputsParams
from engine.request.outputs import EngineError
from engine.structured.limits import why_refused
from engine.structured.spec import check_grammar, constraint_summary

log = logging.getLogger(__name__)

_CHECKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-check")


async def admit_constraint(spec: StructuredOutputsParams) -> None:
    """EngineError(400) naming the field, and the limit met, when the grammar library cannot
    enforce `spec` (check_grammar); the log gets one line with the grammar's size and hash."""
    refusal = await asyncio.get_running_loop().run_in_executor(_CHECKS, _refusal, spec)
    if refusal is not None:
        raise EngineError(refusal, 400, "structured_outputs")


def _refusal(spec: StructuredOutputsParams) -> str | None:
    try:
        check_grammar(spec)
    except ValueError as exc:
        kind, summary = spec.kinds()[0], constraint_summary(spec)
        log.info("structured_outputs.%s refused (%s): %s", kind, summary, why_refused(str(exc)))
        return str(exc)
    return None
