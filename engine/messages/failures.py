"""A request that cannot be served: one message, whichever actor found out, one way home.

Every actor that fails a request sends a RequestFailed down the request path: the tokenizer to
the scheduler, the scheduler (for itself and for the worker ranks) to the detokenizer, and the
detokenizer to the gateway in OutputBatch.failures, which turns it into the client's error
(EngineError.from_failure). Whether a client may retry follows from the status: a 4xx names
what is wrong with the request; a 5xx is the engine's failure.
"""

from __future__ import annotations

import msgspec


class RequestFailed(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    request_id: str
    epoch: int
    status: int  # 400: the request's input is at fault; 500: an internal failure
    message: str
    actor: str  # the role that failed it: tokenizer, scheduler, worker, detokenizer
    param: str | None = None  # the request field at fault, when one is
