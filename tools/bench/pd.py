"""Prefill/decode disaggregation benchmarks.

    python tools/bench/pd.py transfer                       # 1k, 4k, 16k, 64k-token prompts
    python tools/bench/pd.py transfer --tokens 1024 4096 --scatter --repeats 5
    python tools/bench/pd.py serving --window 0:30 --input-scale 16   # tools/bench/pd_serving.py

`transfer`: KV transfer throughput between two kv_transfer actors in their own processes, each
under its own supervisor (as two instances run), for prompts of the given lengths: same host
(the puller maps the source's cache segment and copies) and loopback TCP (forced; raw block
bytes after a msgspec header), beside, in the same run and on the same bytes, a plain memcpy
(numpy copy between the two cache segments, in this process) and a raw loopback socket (one
process sends the bytes with sendall, another receives them with recv_into). The layout
defaults to one rank of Llama-3-8B at TP=2 (32 layers, 4 of its 8 KV heads, head_dim 128,
bfloat16, block 16: 64 KiB per token, so a 64k-token prompt is 4 GiB per cache and the run
needs about 8 GiB of /dev/shm); --kv-heads 8 is the whole model's 128 KiB per token.

A pull's time is the puller's (connect, the handshake on the deployment secret, then the
request to the acknowledgement confirmed), from BlocksPulled; each figure is the median of
--repeats after one warm-up round, and `shm ms` / `tcp ms` are that median pull's milliseconds
(for a small prompt, mostly the connection and handshake). Before the table: the handshake's
cost alone (a connection to another process over loopback, with and without it) and the cost of
signing and checking a prompt's kv_transfer_params (engine/kv/transfer/signing.py).
Blocks are consecutive (a fresh pool) unless --scatter shuffles both sides' ids (no run longer
than chance allows). Figures of one run compare; on a shared 2-core machine they drift between
runs.

glibc copies with ordinary stores below its non-temporal threshold (192 MiB here), and a pull
copies one run per layer's K and V (at most a few tens of MiB), while one memcpy of the whole
transfer crosses it: `GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x400000` before
the command gives every process here (both actors, and this one's memcpy) the same rule.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import secrets
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.actors.configs import KvTransferConfig
from engine.actors.roles import Role
from engine.kv.transfer.handshake import admit_puller, prove_to_server
from engine.kv.transfer.signing import sign, signature_problem
from engine.messages.kv_transfer import (
    KV_EVENTS,
    KV_ORDERS,
    BlocksPulled,
    HoldBlocks,
    KvEndpoint,
    KvEvent,
    KvLayout,
    KvSource,
    PullBlocks,
    TransferEndpoint,
)
from engine.runtime.child_spec import (
    ROOT,
    ChildSpec,
    RingDecl,
    SegmentDecl,
    SupervisorSpec,
)
from engine.runtime.events import ChildReady
from engine.runtime.segments import map_segment
from engine.runtime.supervisor import Supervisor
from tools.bench.pd_serving import add_arguments as add_serving_arguments
from tools.bench.pd_serving import serving

TIMEOUT = 600.0  # a pull's deadline, and the longest wait for any event
SECRET = secrets.token_bytes(32)  # this run's deployment secret, shared by both instances


# ---- transfer ----------------------------------------------------------------------------------


class KvInstance:
    """One kv_transfer actor (rank 0) under its own supervisor; this process is its scheduler."""

    def __init__(self, name: str, layout: KvLayout, force_tcp: bool) -> None:
        config = KvTransferConfig(
            rank=0, layout=layout, cache_segment="cache", force_tcp=force_tcp, secret=SECRET
        )
        child = ChildSpec(
            name="kv0",
            entry="engine.actors.kv_transfer:KvTransferActor",
            role=Role.KV_TRANSFER,
            config=msgspec.msgpack.encode(config),
        )
        self.name = name
        self.spec = SupervisorSpec(
            children=(child,),
            rings=(
                RingDecl(name="kv-orders", writer=ROOT, readers=("kv0",), capacity=1 << 20),
                RingDecl(name="kv-events0", writer="kv0", readers=(ROOT,), capacity=1 << 20),
            ),
            segments=(SegmentDecl(name="cache", size=layout.segment_bytes, parties=("kv0",)),),
        )
        self.supervisor = Supervisor(self.spec)
        self.events: list[KvEvent] = []

    async def start(self) -> None:
        ready = self.supervisor.subscribe()
        await self.supervisor.start()
        event = await asyncio.wait_for(ready.get(), TIMEOUT)
        assert isinstance(event, ChildReady), event
        self.segment: str = event.info["cache_segment"]
        self.cache = np.frombuffer(map_segment(self.segment), dtype=np.uint8)
        self.endpoint = await self.next(TransferEndpoint)

    async def order(self, message: Any) -> None:
        await self.supervisor.root.send_many("kv-orders", [KV_ORDERS.encode(message)])

    async def next(self, kind: type[Any]) -> Any:
        while True:
            for index, event in enumerate(self.events):
                if isinstance(event, kind):
                    return self.events.pop(index)
            received = await asyncio.wait_for(self.supervisor.root.mailbox.recv(), TIMEOUT)
            for _, frames in received:
                self.events.extend(KV_EVENTS.decode_many(frames))


@dataclass
class TransferFigures:
    tokens: int
    num_bytes: int
    shm_s: float
    tcp_s: float
    memcpy_s: float
    socket_s: float

    def row(self) -> str:
        def rate(seconds: float) -> float:
            return self.num_bytes / seconds / 1e9

        shm, tcp, memcpy, raw = map(rate, (self.shm_s, self.tcp_s, self.memcpy_s, self.socket_s))
        return (
            f"{self.tokens:>7} {self.num_bytes / 2**20:>9.0f} {shm:>8.2f} {memcpy:>8.2f} "
            f"{shm / memcpy:>8.0%} {tcp:>8.2f} {raw:>8.2f} {tcp / raw:>8.0%} "
            f"{self.shm_s * 1e3:>8.2f} {self.tcp_s * 1e3:>8.2f}"
        )


HEADER = (
    f"{'tokens':>7} {'MiB':>9} {'shm':>8} {'memcpy':>8} {'shm/mc':>8} {'tcp':>8} {'socket':>8} "
    f"{'tcp/sock':>8} {'shm ms':>8} {'tcp ms':>8}   (GB/s but ms)"
)


def _handshake_server(listener: socket.socket, secret: bytes, repeats: int) -> None:
    """The handshake's serving process: `repeats` plain connections, then as many handshakes."""
    for attempt in range(2 * repeats):
        with listener.accept()[0] as connection:
            if attempt >= repeats:
                admit_puller(connection, secret)
            connection.recv(1)  # until the client closes


def security_costs(layout: KvLayout, blocks: int, repeats: int = 200) -> str:
    """Median microseconds: a loopback connection to another process, with and without the
    handshake, and signing / checking kv_transfer_params naming `blocks` blocks."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    server = multiprocessing.get_context("fork").Process(
        target=_handshake_server, args=(listener, SECRET, repeats), daemon=True
    )
    server.start()

    def connection_us(handshake: bool) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            with socket.create_connection(address, timeout=TIMEOUT) as sock:
                if handshake:
                    prove_to_server(sock, SECRET, time.monotonic() + TIMEOUT)
                else:
                    sock.getpeername()
                times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e6

    try:
        plain, authenticated = connection_us(False), connection_us(True)
    finally:
        server.join(TIMEOUT)
        listener.close()
    endpoint = KvEndpoint("127.0.0.1", 7100, "host")
    source = KvSource(secrets.token_hex(16), [endpoint], list(range(blocks)), 0, layout, "ab" * 16)
    signing, checking = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        signed = sign(source, SECRET, time.time() + 60)
        signing.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert signature_problem(signed, SECRET, time.time()) is None
        checking.append(time.perf_counter() - started)
    median = statistics.median
    return (
        f"connect {plain:.0f} us, connect + handshake {authenticated:.0f} us (loopback, another "
        f"process serving); kv_transfer_params of {blocks} blocks: sign "
        f"{median(signing) * 1e6:.0f} us, check {median(checking) * 1e6:.0f} us"
    )


async def pull_seconds(
    source: KvInstance, puller: KvInstance, src: list[int], dst: list[int], attempt: str
) -> float:
    """One hold on `source`, one pull by `puller`: the puller's seconds."""
    transfer_id = f"bench-{attempt}@0"
    layout = source.endpoint.layout
    await source.order(HoldBlocks(transfer_id, src, time.monotonic() + TIMEOUT))
    kv_source = KvSource(
        transfer_id, [source.endpoint.endpoint], src, len(src) * layout.block_size, layout
    )
    deadline = time.monotonic() + TIMEOUT
    await puller.order(PullBlocks(transfer_id, kv_source, src, dst, deadline))
    pulled: BlocksPulled = await puller.next(BlocksPulled)
    if pulled.error is not None:
        raise RuntimeError(pulled.error)
    return pulled.seconds


def memcpy_seconds(src: np.ndarray, dst: np.ndarray, num_bytes: int) -> float:
    started = time.perf_counter()
    np.copyto(dst[:num_bytes], src[:num_bytes])
    return time.perf_counter() - started


def _raw_sender(segment: str, num_bytes: int, port: int, repeats: int) -> None:
    """The raw socket's sending process: sendall of the bytes, once per go byte."""
    data = memoryview(map_segment(segment, writable=False))[:num_bytes]
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        for _ in range(repeats):
            sock.recv(1)
            sock.sendall(data)


def raw_socket_seconds(segment: str, dst: np.ndarray, num_bytes: int, repeats: int) -> list[float]:
    """Loopback TCP between two processes, the same bytes, straight into `dst`."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TIMEOUT)
    port = listener.getsockname()[1]
    sender = multiprocessing.get_context("spawn").Process(
        target=_raw_sender, args=(segment, num_bytes, port, repeats), daemon=True
    )
    sender.start()
    seconds = []
    try:
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(TIMEOUT)
            view = memoryview(dst)[:num_bytes]
            for _ in range(repeats):
                started = time.perf_counter()
                connection.sendall(b"g")
                got = 0
                while got < num_bytes:
                    received = connection.recv_into(view[got:])
                    if not received:
                        raise RuntimeError("the raw sender closed early")
                    got += received
                seconds.append(time.perf_counter() - started)
    finally:
        listener.close()
        sender.join(TIMEOUT)
    return seconds


async def bench_transfer(args: argparse.Namespace) -> list[TransferFigures]:
    max_blocks = max(args.tokens) // args.block_size
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[args.dtype]
    layout = KvLayout(
        f"BenchForCausalLM/L{args.layers}/H{args.kv_heads}/D{args.head_dim}",
        args.layers,
        args.kv_heads,
        args.head_dim,
        args.block_size,
        args.dtype,
        itemsize,
        1,
        0,
        num_blocks=max_blocks,
    )
    print(
        f"layout: {args.layers} layers, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
        f"{args.dtype}, block {args.block_size}: {layout.block_bytes // args.block_size // 1024} "
        f"KiB per token; caches of {layout.segment_bytes / 2**30:.2f} GiB each; "
        f"{'scattered' if args.scatter else 'consecutive'} blocks; median of {args.repeats}",
        flush=True,
    )
    print(security_costs(layout, max_blocks), flush=True)
    # `near` pulls through shared memory, `far` over TCP; each serves the other.
    near, far = KvInstance("near", layout, False), KvInstance("far", layout, True)
    await near.start()
    await far.start()
    try:
        rng = np.random.default_rng(0)
        for instance in (near, far):  # real bytes, every page touched before timing
            for start in range(0, instance.cache.size, 1 << 28):
                part = instance.cache[start : start + (1 << 28)]
                part[:] = rng.integers(0, 256, part.size, dtype=np.uint8)
        figures = []
        for tokens in args.tokens:
            figures.append(await _transfer_figures(args, near, far, tokens, rng))
            print(figures[-1].row() if len(figures) > 1 else f"{HEADER}\n{figures[-1].row()}")
        return figures
    finally:
        await far.supervisor.shutdown("benchmark over")
        await near.supervisor.shutdown("benchmark over")


async def _transfer_figures(
    args: argparse.Namespace,
    near: KvInstance,
    far: KvInstance,
    tokens: int,
    rng: np.random.Generator,
) -> TransferFigures:
    blocks = tokens // args.block_size
    src, dst = list(range(blocks)), list(range(blocks))
    if args.scatter:
        src = [int(b) for b in rng.permutation(blocks)]
        dst = [int(b) for b in rng.permutation(blocks)]
    num_bytes = blocks * near.endpoint.layout.block_bytes
    shm, tcp, memcpy = [], [], []
    # A warm-up round, not counted: the first pull into (or from) pages a process has not
    # touched yet pays their page faults (about as long as the copy itself).
    cold_shm = await pull_seconds(far, near, src, dst, f"shm-{tokens}-warm-up")
    cold_tcp = await pull_seconds(near, far, src, dst, f"tcp-{tokens}-warm-up")
    for attempt in range(args.repeats):
        shm.append(await pull_seconds(far, near, src, dst, f"shm-{tokens}-{attempt}"))
        tcp.append(await pull_seconds(near, far, src, dst, f"tcp-{tokens}-{attempt}"))
        memcpy.append(memcpy_seconds(far.cache, near.cache, num_bytes))
    raw = await asyncio.to_thread(
        raw_socket_seconds, near.segment, far.cache, num_bytes, args.repeats
    )
    median = statistics.median
    if args.verbose:
        rounded = [[round(s, 4) for s in attempts] for attempts in (shm, tcp, memcpy, raw)]
        print(
            f"  {tokens} tokens: warm-up shm {cold_shm:.4f} s, tcp {cold_tcp:.4f} s; seconds "
            f"per attempt: shm, tcp, memcpy, socket {rounded}"
        )
    return TransferFigures(tokens, num_bytes, median(shm), median(tcp), median(memcpy), median(raw))


# ---- command line ------------------------------------------------------------------------------


def main() -> int:
    args = parse_args()
    if args.command == "serving":
        return serving(args)
    asyncio.run(bench_transfer(args))
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    transfer = commands.add_parser("transfer", help="KV transfer throughput (GB/s)")
    transfer.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    transfer.add_argument("--layers", type=int, default=32)
    transfer.add_argument("--kv-heads", type=int, default=4, help="this rank's (8B at TP=2: 4)")
    transfer.add_argument("--head-dim", type=int, default=128)
    transfer.add_argument("--block-size", type=int, default=16)
    transfer.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    transfer.add_argument("--repeats", type=int, default=3)
    transfer.add_argument("--verbose", action="store_true", help="print every attempt's seconds")
    transfer.add_argument("--scatter", action="store_true", help="shuffle both sides' block ids")
    add_serving_arguments(
        commands.add_parser("serving", help="disaggregated vs colocated on a trace window")
    )
    args = parser.parse_args()
    if args.command == "transfer":
        for tokens in args.tokens:
            if tokens <= 0 or tokens % args.block_size:
                parser.error(f"--tokens must be positive multiples of --block-size, got {tokens}")
    return args


if __name__ == "__main__":
    sys.exit(main())
