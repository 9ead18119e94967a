"""The scheduler with LoRA adapters, driven by the reference worker of test_scheduler: the prefix
cache never gives one adapter's KV to another (or to the base model), and no step runs more than
max_loras distinct adapters, while every request still gets all its tokens."""

from __future__ import annotations

from engine.messages.params import LoRARequest
from tests.unit.test_scheduler import Outputs, expected, make, run_to_end, step, submit

ADAPTERS = [LoRARequest(f"adapter{i}", i + 1, f"/adapters/{i}") for i in range(3)]


def first_chunk_start(scheduler, worker, request) -> int:  # type: ignore[no-untyped-def]
    scheduler.add(request)
    plan = scheduler.schedule()
    assert plan is not None and len(plan.chunks) == 1
    start = plan.chunks[0].start_pos
    outputs = Outputs()
    outputs.add(scheduler.update(worker.run(plan)))
    while step(scheduler, worker, outputs) is not None:
        pass
    return start


def test_the_prefix_cache_keeps_each_adapters_kv_to_itself() -> None:
    scheduler, worker = make()
    system = list(range(1, 13))  # three full blocks
    scheduler.add(submit("a", [*system, 50], max_tokens=1, lora_request=ADAPTERS[0]))
    run_to_end(scheduler, worker)
    other = submit("b", [*system, 60], max_tokens=2, lora_request=ADAPTERS[1])
    assert first_chunk_start(scheduler, worker, other) == 0
    base = submit("base", [*system, 61], max_tokens=2)
    assert first_chunk_start(scheduler, worker, base) == 0
    same = submit("a2", [*system, 62], max_tokens=2, lora_request=ADAPTERS[0])
    assert first_chunk_start(scheduler, worker, same) == 12
    # The same name from another path (unloaded, loaded again) is another adapter.
    moved = LoRARequest("adapter0", 1, "/adapters/elsewhere")
    assert first_chunk_start(scheduler, worker, submit("m", [*system, 63], lora_request=moved)) == 0


def test_no_step_runs_more_than_max_loras_adapters_and_every_request_finishes() -> None:
    scheduler, worker = make(max_loras=2)
    loras = [ADAPTERS[0], None, ADAPTERS[1], ADAPTERS[2], ADAPTERS[0], None, ADAPTERS[2]]
    for i, lora in enumerate(loras):
        scheduler.add(submit(f"r{i}", [i + 1, 2, 3], max_tokens=4, lora_request=lora))
    outputs = Outputs()
    seen_adapters = set()
    while step(scheduler, worker, outputs) is not None:
        running = {s.params.lora_request for s in scheduler.planner.running} - {None}
        assert len(running) <= 2
        seen_adapters |= running
    assert seen_adapters == set(ADAPTERS)
    for i in range(len(loras)):
        assert outputs.tokens[f"r{i}", 0] == expected([i + 1, 2, 3], 1, 4)
