"""The package's layering, read from the source with `ast` (no imports run): no import cycles
inside `engine/`, `tools/` or `tests/`, lazy imports inside functions included, and the layering
rules: the actor runtime knows nothing of LLMs, messages know nothing of actors, the package
imports neither tools nor tests, and tools and tests never import each other."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "engine"
TOOLS = ROOT / "tools"  # scripts by purpose (bench/, chaos/, peers/, data/), importing `tools.x.y`
TESTS = ROOT / "tests"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    found |= {module_name(path): path for path in TOOLS.rglob("*.py")}
    return found | {module_name(path): path for path in TESTS.rglob("*.py")}


def imported(path: Path, name: str, known: set[str]) -> Iterator[str]:
    """Modules of `engine` and `tools` that `path` imports anywhere in its body (a `from pkg
    import mod` counts as importing `pkg.mod` when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if t in known else base for t in targets]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


@functools.cache  # read once for all the tests here (never mutated)
def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: set(imported(path, name, known)) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def violations(graph: dict[str, set[str]], layer: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{module} imports {target}"
        for module, targets in sorted(graph.items())
        if module == layer or module.startswith(layer + ".")
        for target in sorted(targets)
        if any(target == f or target.startswith(f + ".") for f in forbidden)
    ]


def test_there_is_no_import_cycle_inside_engine_or_tools() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_there_is_no_cycle_between_engines_packages() -> None:
    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])  # engine.<package> (or a top-level module)

    packages: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        if module.startswith("tests."):
            continue  # the tests' folders share fixtures both ways; only modules must not cycle
        own = package(module)
        packages.setdefault(own, set()).update(package(t) for t in targets if package(t) != own)
    found = cycles(packages)
    assert not found, "package cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_actor_runtime_knows_nothing_of_llms() -> None:
    llm_packages = [
        "actors",
        "model",
        "kv",
        "lora",
        "launch",
        "request",
        "proxy",
        "library",
        "http",
        "scheduler",
        "inflight",
        "kernels",
        "text",
    ]
    forbidden = tuple(f"engine.{p}" for p in llm_packages)
    assert violations(import_graph(), "engine.runtime", forbidden) == []


def test_messages_know_nothing_of_actors() -> None:
    assert violations(import_graph(), "engine.messages", ("engine.actors",)) == []


def test_the_package_tools_and_tests_import_only_downwards() -> None:
    """The package imports neither the scripts nor the tests, and the scripts and the tests never
    import each other: what both need (starting and stopping a server, the benchmarks' figures)
    lives in the package."""
    graph = import_graph()
    assert violations(graph, "engine", ("tools", "tests")) == []
    assert violations(graph, "tools", ("tests",)) == []
    assert violations(graph, "tests", ("tools",)) == []


def test_the_checker_sees_a_cycle_and_a_lazy_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    source = PACKAGE / "actors" / "worker.py"
    assert any(imported(source, "engine.actors.worker", set(modules())))


def test_the_package_top_holds_no_loose_modules() -> None:
    # Each module belongs to the package of its concern; the top holds only the library's
    # public names (__init__) and `python -m engine` (__main__).
    assert sorted(path.name for path in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py"]


def test_no_production_module_imports_the_test_hooks() -> None:
    # Fault injection is installed from outside, by a hook a test sets (engine/runtime/hooks.py).
    graph = {m: ts for m, ts in import_graph().items() if not m.startswith("engine.testing")}
    assert violations(graph, "engine", ("engine.testing",)) == []
