"""One shared server for the e2e tests that leave it running; tests that stop a server start
their own. Every server is terminated, waited for and, if need be, killed here."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from engine.testing import combined
from engine.testing.http_faults import environment as http_faults
from tests.checkpoints import CACHE_ROOT
from tests.e2e.harness import API_KEY, Server, served
from tests.holds import hold_env

MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 4
MAX_QUEUED = 8  # samples: a request with n samples counts n
MAX_REQUEST_BYTES = 64 * 1024
# The shared server's HTTP fault injection (engine/testing/http_faults.py): a request body
# holding one of these fails as a bug in the server would (tests/e2e/test_no_resets.py).
FAULT_500 = "engine-test-fault-500"
FAULT_IN_STREAM = "engine-test-fault-in-stream"


@pytest.fixture(scope="session")
def model_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Flags naming the small test checkpoint."""
    # Until the engine client and the test checkpoints land, the e2e suite has nothing to run.
    engine = pytest.importorskip("engine")
    if not hasattr(engine, "AsyncLLM"):
        pytest.skip("engine.AsyncLLM is not there yet")
    checkpoints = pytest.importorskip("tests.checkpoints")
    tiny_checkpoint = checkpoints.tiny_checkpoint

    return ["--model", str(tiny_checkpoint())]


def server_args(model_args: list[str], socket: Path | None, *extra: str) -> list[str]:
    args = [
        *model_args,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--device",
        "cpu",
        "--api-key",
        API_KEY,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-queued-samples",
        str(MAX_QUEUED),
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        "--kv-cache-memory",
        "16MiB",
        "--drain-timeout",
        "30",
    ]
    if socket is not None:
        args += ["--admin.socket", str(socket)]
    return [*args, *extra]


def without_api_key(args: list[str]) -> list[str]:
    """`args` with no --api-key: a key on the command line draws its own warning line (issue 46),
    which a test of a refused start's one line does not want."""
    at = args.index("--api-key")
    return [*args[:at], *args[at + 2 :]]


@pytest.fixture(scope="session")
def otlp() -> Iterator[Any]:
    """The OTLP receiver the shared server sends its request spans to (tests/otlp_receiver.py);
    None without the OpenTelemetry SDK (the extra engine[otel])."""
    if importlib.util.find_spec("opentelemetry.sdk") is None:
        yield None
        return
    from tests.otlp_receiver import otlp_receiver

    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def server(
    model_args: list[str], tmp_path_factory: pytest.TempPathFactory, otlp: Any
) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("server")
    trace = work / "trace.jsonl"
    args = server_args(model_args, work / "admin.sock", "--server.record_trace", str(trace))
    # LoRA on: test_lora_serving loads its adapters at run time (and unloads them after), from
    # the test checkpoints' directory and the tests' temporary ones.
    allowed = f"{CACHE_ROOT},{tmp_path_factory.getbasetemp()}"
    args += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    args += ["--lora-path-allow", allowed]
    # Prompts holding tests/holds.py's HOLD_TEXT are held in flight while a test acts on them.
    env = combined(http_faults(f"raise:{FAULT_500},raise-in-stream:{FAULT_IN_STREAM}"), hold_env())
    if otlp is not None:
        args += ["--otlp-traces-endpoint", otlp.url]
        env["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # ms: export spans soon after each request
    with served(args, work, env, name="shared") as srv:
        srv.extra["trace"] = trace
        yield srv


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai_client(server, timeout=60.0) as c:
        yield c


@contextmanager
def openai_client(server: Server, timeout: float) -> Iterator[openai.OpenAI]:
    """The `openai` package's client for `server`, without retries (a test sees each answer)."""
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, timeout=timeout, max_retries=0
    ) as c:
        yield c
