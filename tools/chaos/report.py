"""What tools/chaos/run.py prints: the chaos run's streams against their undisturbed twins, and the
recovery after each fault."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tools.chaos.faults import Fault
from tools.chaos.workload import Stream


def recovery_times(streams: list[Stream], faults: list[Fault]) -> list[tuple[str, float]]:
    """Per fault ('<kind> <victim>', seconds): until every stream in flight at the fault (and
    not yet done) got a new token."""
    out = []
    for fault in faults:
        waits = []
        for stream in streams:
            if not stream.start <= fault.at < stream.end:
                continue
            following = [t for t in stream.times if t > fault.at]
            if following:
                waits.append(following[0] - fault.at)
        if waits:
            out.append((f"{fault.kind} {_actor_kind(fault.name)}", max(waits)))
    return out


def _actor_kind(name: str) -> str:
    """'prefill:worker0-r1' -> 'prefill:worker': recovery figures by kind of actor."""
    return name.rstrip("0123456789").split("-r")[0].rstrip("0123456789")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def compare(chaos: list[Stream], reference: list[Stream]) -> dict[str, Any]:
    lost = [i for i, s in enumerate(chaos) if not s.completed]
    mismatched = [
        i
        for i, (s, r) in enumerate(zip(chaos, reference, strict=True))
        if s.completed and (s.tokens != r.tokens or s.text != r.text)
    ]
    duplicated = sum(
        max(0, len(s.tokens) - len(r.tokens))
        for s, r in zip(chaos, reference, strict=True)
        if s.completed
    )
    return {
        "requests": len(chaos),
        "completed": len(chaos) - len(lost),
        "lost": len(lost),
        "mismatched": len(mismatched),
        "duplicated_tokens": duplicated,
        "reference_failures": sum(1 for r in reference if not r.completed),
        "lost_examples": [(i, chaos[i].error) for i in lost[:5]],
        "mismatched_examples": [
            describe_mismatch(i, chaos[i], reference[i]) for i in mismatched[:5]
        ],
        "tokens": sum(len(s.tokens) for s in chaos),
    }


def describe_mismatch(index: int, chaos: Stream, reference: Stream) -> str:
    """Where request `index` first differs from its undisturbed twin, with its id to find it in
    the server log."""
    pairs = zip(chaos.tokens, reference.tokens, strict=False)
    at = next((k for k, (a, b) in enumerate(pairs) if a != b), None)
    if at is None:
        at = min(len(chaos.tokens), len(reference.tokens))
    return (
        f"request {index} ({chaos.request_id}): tokens differ from #{at} "
        f"({len(chaos.tokens)} vs {len(reference.tokens)} tokens): "
        f"{chaos.tokens[at : at + 3]!r} vs {reference.tokens[at : at + 3]!r}; "
        f"text equal: {chaos.text == reference.text}"
    )


def restarts_by_actor(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> Counter[str]:
    was = {row["name"]: row["restarts"] for row in before}
    return Counter({row["name"]: row["restarts"] - was.get(row["name"], 0) for row in after})


def longest_stall(streams: list[Stream]) -> float:
    gaps = [b - a for s in streams for a, b in zip([s.start, *s.times], s.times, strict=False)]
    return max(gaps, default=0.0)


def print_summary(s: dict[str, Any]) -> None:
    def by_actor(counts: dict[str, int]) -> str:
        return ", ".join(f"{name} {n}" for name, n in sorted(counts.items()) if n) or "none"

    def seconds(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f} s"

    rows = [
        ("requests", s["requests"]),
        ("completed", s["completed"]),
        ("lost", s["lost"]),
        ("mismatched", s["mismatched"]),
        ("duplicated tokens", s["duplicated_tokens"]),
        ("tokens streamed", s["tokens"]),
        ("faults", f"{s['faults']} ({by_actor(s['faults_by_kind'])})"),
        ("faults by victim", by_actor(s["faults_by_actor"])),
        ("hung, not replaced", ", ".join(s["hung_never_replaced"]) or "none"),
        ("restarts by actor", by_actor(s["restarts_by_actor"])),
        (
            "recovery p50 / p99",
            f"{seconds(s['recovery_p50_s'])} / {seconds(s['recovery_p99_s'])}"
            f" (max {seconds(s['recovery_max_s'])}; fault -> next token on every stream in flight)",
        ),
        (
            "recovery by victim",
            ", ".join(
                f"{name} {p50:.3f} / {s['recovery_p99_by_actor_s'][name]:.3f} s"
                for name, p50 in s["recovery_p50_by_actor_s"].items()
            )
            or "n/a",
        ),
        ("longest stall", seconds(s["longest_stall_s"])),
        ("phases", f"chaos {s['chaos_phase_s']:.1f} s, reference {s['reference_phase_s']:.1f} s"),
    ]
    for name, value in rows:
        print(f"{name:20s} {value}")
    if s["lost_examples"]:
        print(f"lost, e.g.: {s['lost_examples']}")
    if s["mismatched_examples"]:
        for example in s["mismatched_examples"]:
            print(f"mismatched: {example}")
    if s["reference_failures"]:
        print(f"warning: {s['reference_failures']} request(s) failed in the undisturbed run too")
