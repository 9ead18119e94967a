"""What a tenant may ask of a request, decided once its front end built it: the model, the
priority within the tenant's ceiling, and the names a request is known by (client-chosen ids
are the tenant's own: two tenants may use the same one, and neither reaches the other's).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.messages.requests import EngineRequest
from engine.request.outputs import EngineError
from engine.tenants.table import EVERYONE, Tenant

MAX_CACHE_SALT_CHARS = 256


def run_as(
    tenant: Tenant,
    requests: Iterable[EngineRequest],
    model: str,
    priority: int | None,
    cache_salt: str | None,
) -> None:
    """Tag each request of one API call with its tenant, priority and salt; EngineError 404
    for a model the tenant may not use (as OpenAI answers for a model one has no access to),
    403 for a priority more urgent than its ceiling, 400 for a salt that is no salt."""
    check_model_access(tenant, model)
    if priority is not None and priority < tenant.priority_ceiling:
        raise EngineError(
            f"priority {priority} is more urgent than tenant {tenant.name!r} may ask for (its "
            f"priority_ceiling is {tenant.priority_ceiling}; lower values run first)",
            403,
            "priority",
        )
    if cache_salt is not None and not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise EngineError(
            f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters", 400, "cache_salt"
        )
    for request in requests:
        request.tenant = tenant.tag if tenant is not EVERYONE else None
        request.priority = tenant.default_priority if priority is None else priority
        request.cache_salt = cache_salt


def check_model_access(tenant: Tenant, model: str) -> None:
    if not tenant.may_use(model):
        raise EngineError(
            f"the model '{model}' does not exist or tenant {tenant.name!r} has no access to it",
            404,
            "model",
        )


def scoped_id(tenant: Tenant, request_id: str) -> str:
    """A client-chosen id within its tenant's namespace: the id the engine knows it by. The
    one tenant of a server without tenants keeps ids as they are."""
    return request_id if tenant is EVERYONE else f"{tenant.name}/{request_id}"


def tenant_name(request: EngineRequest) -> str:
    """The name of the tenant a request runs for."""
    return EVERYONE.name if request.tenant is None else request.tenant.name
