"""IPC benchmark: our shared-memory ring vs ZeroMQ ipc PUSH/PULL vs multiprocessing.Queue.

Every transport carries the same ~200-byte msgspec message between two spawned processes, and
does the same work per message: the producer encodes it, the consumer decodes it. Measured in
one run, so the ratios are fair even on a busy machine:

- one-way throughput: a producer process streams N messages to a consumer process (the ring
  producer hands frames over in batches, as actors do; "ring, unbatched" sends one at a time);
- round trip: a pinger process sends one message, a ponger decodes it and answers, p50 / p99;
- the CPU a parked ring consumer burns while no traffic comes (its own getrusage).

    .venv/bin/python tools/bench/ipc.py            # table with ratios
    .venv/bin/python tools/bench/ipc.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import uvloop
import zmq

from engine.runtime.ring import (
    RingReader,
    RingSpec,
    RingWriter,
    create_ring,
    destroy_ring,
    run_prefix,
)

# 64 KiB (about 330 of these messages, zmq's default high-water mark is 1000): a ring that fits in
# the L2 cache keeps the producer's writes hot for the consumer; with 1 MiB the consumer's copies
# miss the cache and one-way throughput drops by roughly a fifth on the 2-core dev machines.
DEFAULT_RING_CAPACITY = 64 * 1024
JOIN_TIMEOUT_S = 60.0


class BenchMessage(msgspec.Struct):
    """Shaped like a per-request output: ids, a few tokens, a bit of text."""

    request_id: str
    seq: int
    epoch: int
    token_ids: list[int]
    text: str
    finished: bool


def make_message() -> BenchMessage:
    return BenchMessage(
        request_id="cmpl-6f1c2e9a4b7d4e0f8a3b5c7d9e1f2a4b",
        seq=0,
        epoch=1,
        token_ids=[9001, 15, 27, 4096, 318, 257, 1332, 286, 262, 8200, 1080, 13],
        text="The quick brown fox jumps over the lazy dog, and then it runs back home.",
        finished=False,
    )


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(BenchMessage)


def _report(conn: Connection, **values: Any) -> None:
    conn.send_bytes(msgspec.msgpack.encode(values))  # no pickle on our result channel either


def _result(conn: Connection, what: str) -> dict[str, Any]:
    if not conn.poll(JOIN_TIMEOUT_S):
        raise TimeoutError(f"{what}: no result within {JOIN_TIMEOUT_S} s")
    result: dict[str, Any] = msgspec.msgpack.decode(conn.recv_bytes())
    return result


# -- ring ------------------------------------------------------------------------------------


def ring_producer(spec: RingSpec, n: int, batch: int, conn: Connection) -> None:
    async def main() -> None:
        with RingWriter(spec) as writer:
            message = make_message()
            started = time.perf_counter()
            for first in range(0, n, batch):
                frames = []
                for seq in range(first, min(first + batch, n)):
                    message.seq = seq
                    frames.append(ENCODER.encode(message))
                if batch == 1:
                    await writer.send(frames[0])
                else:
                    await writer.send_many(frames)
            _report(conn, started=started)

    uvloop.run(main())


def ring_consumer(spec: RingSpec, n: int, conn: Connection) -> None:
    async def main() -> None:
        with RingReader(spec) as reader:
            _report(conn, ready=True)
            received = 0
            while received < n:
                frames = await reader.recv_many()
                for frame in frames:
                    DECODER.decode(frame)
                received += len(frames)
            _report(conn, finished=time.perf_counter())

    uvloop.run(main())


def ring_ponger(ping: RingSpec, pong: RingSpec, rounds: int, conn: Connection) -> None:
    async def main() -> None:
        with RingReader(ping) as reader, RingWriter(pong) as writer:
            _report(conn, ready=True)
            for _ in range(rounds):
                message = DECODER.decode(await reader.recv())
                await writer.send(ENCODER.encode(message))

    uvloop.run(main())


def ring_pinger(ping: RingSpec, pong: RingSpec, rounds: int, conn: Connection) -> None:
    async def main() -> None:
        with RingWriter(ping) as writer, RingReader(pong) as reader:
            message = make_message()
            rtts = []
            for seq in range(rounds):
                message.seq = seq
                started = time.perf_counter_ns()
                await writer.send(ENCODER.encode(message))
                DECODER.decode(await reader.recv())
                rtts.append(time.perf_counter_ns() - started)
            _report(conn, rtts_ns=rtts)

    uvloop.run(main())


def ring_idle_consumer(spec: RingSpec, conn: Connection) -> None:
    async def main() -> None:
        with RingReader(spec) as reader:
            _report(conn, ready=True)
            cpu_before = _cpu_seconds()
            wall_before = time.perf_counter()
            await reader.recv()
            cpu = _cpu_seconds() - cpu_before
            _report(conn, cpu_pct=100.0 * cpu / (time.perf_counter() - wall_before))

    uvloop.run(main())


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- ZeroMQ ----------------------------------------------------------------------------------


def zmq_producer(address: str, n: int, conn: Connection) -> None:
    with zmq.Context() as context, context.socket(zmq.PUSH) as socket:
        socket.connect(address)
        message = make_message()
        started = time.perf_counter()
        for seq in range(n):
            message.seq = seq
            socket.send(ENCODER.encode(message))
        _report(conn, started=started)
        socket.setsockopt(zmq.LINGER, 10_000)


def zmq_consumer(address: str, n: int, conn: Connection) -> None:
    with zmq.Context() as context, context.socket(zmq.PULL) as socket:
        socket.bind(address)
        _report(conn, ready=True)
        for _ in range(n):
            DECODER.decode(socket.recv())
        _report(conn, finished=time.perf_counter())


def zmq_ponger(ping: str, pong: str, rounds: int, conn: Connection) -> None:
    with (
        zmq.Context() as context,
        context.socket(zmq.PULL) as pulls,
        context.socket(zmq.PUSH) as pushes,
    ):
        pulls.bind(ping)
        pushes.bind(pong)
        _report(conn, ready=True)
        for _ in range(rounds):
            pushes.send(ENCODER.encode(DECODER.decode(pulls.recv())))


def zmq_pinger(ping: str, pong: str, rounds: int, conn: Connection) -> None:
    with (
        zmq.Context() as context,
        context.socket(zmq.PUSH) as pushes,
        context.socket(zmq.PULL) as pulls,
    ):
        pushes.connect(ping)
        pulls.connect(pong)
        message = make_message()
        rtts = []
        for seq in range(rounds):
            message.seq = seq
            started = time.perf_counter_ns()
            pushes.send(ENCODER.encode(message))
            DECODER.decode(pulls.recv())
            rtts.append(time.perf_counter_ns() - started)
        _report(conn, rtts_ns=rtts)


# -- multiprocessing.Queue (pickles under the hood: it is the peer being measured) -------------
# get() without a timeout, as its users call it: a timeout adds a poll() per message. A hung
# child cannot hang the benchmark: the parent waits for results with a timeout and kills it.


def queue_producer(queue: Any, n: int, conn: Connection) -> None:
    message = make_message()
    started = time.perf_counter()
    for seq in range(n):
        message.seq = seq
        queue.put(ENCODER.encode(message))
    _report(conn, started=started)
    queue.close()
    queue.join_thread()


def queue_consumer(queue: Any, n: int, conn: Connection) -> None:
    _report(conn, ready=True)
    for _ in range(n):
        DECODER.decode(queue.get())
    _report(conn, finished=time.perf_counter())


def queue_ponger(ping: Any, pong: Any, rounds: int, conn: Connection) -> None:
    _report(conn, ready=True)
    for _ in range(rounds):
        pong.put(ENCODER.encode(DECODER.decode(ping.get())))
    pong.close()
    pong.join_thread()


def queue_pinger(ping: Any, pong: Any, rounds: int, conn: Connection) -> None:
    message = make_message()
    rtts = []
    for seq in range(rounds):
        message.seq = seq
        started = time.perf_counter_ns()
        ping.put(ENCODER.encode(message))
        DECODER.decode(pong.get())
        rtts.append(time.perf_counter_ns() - started)
    _report(conn, rtts_ns=rtts)


# -- orchestration ---------------------------------------------------------------------------


class Children:
    """The processes of one measurement; all are joined or killed before the next."""

    def __init__(self) -> None:
        self._context = mp.get_context("spawn")
        self._running: list[Any] = []

    def start(self, target: Callable[..., None], *args: Any) -> Connection:
        """Start `target(*args, results)` in a spawned process; returns the results end."""
        results, child_end = self._context.Pipe(duplex=False)
        process = self._context.Process(target=target, args=(*args, child_end), daemon=True)
        process.start()
        child_end.close()
        self._running.append(process)
        return results

    def queue(self) -> Any:
        return self._context.Queue()

    def join(self) -> None:
        failed = []
        for process in self._running:
            process.join(JOIN_TIMEOUT_S)
            if process.exitcode != 0:
                failed.append(f"{process.name} exit code {process.exitcode}")
        self.kill()
        if failed:
            raise RuntimeError("benchmark process failed: " + ", ".join(failed))

    def kill(self) -> None:
        for process in self._running:
            if process.is_alive():
                process.kill()
            process.join(JOIN_TIMEOUT_S)
        self._running.clear()


def one_way(
    children: Children, consumer: tuple[Any, ...], producer: tuple[Any, ...], n: int
) -> float:
    consumer_results = children.start(*consumer)
    _result(consumer_results, f"{consumer[0].__name__} ready")
    producer_results = children.start(*producer)
    started = _result(producer_results, producer[0].__name__)["started"]
    finished = _result(consumer_results, consumer[0].__name__)["finished"]
    children.join()
    return float(n / (finished - started))


def round_trips(
    children: Children, ponger: tuple[Any, ...], pinger: tuple[Any, ...], warmup: int
) -> tuple[float, float]:
    ponger_results = children.start(*ponger)
    _result(ponger_results, f"{ponger[0].__name__} ready")
    rtts_ns = _result(children.start(*pinger), pinger[0].__name__)["rtts_ns"][warmup:]
    children.join()
    cuts = statistics.quantiles(rtts_ns, n=100)
    return cuts[49] / 1000, cuts[98] / 1000


def idle_cpu(children: Children, spec: RingSpec, seconds: float) -> float:
    results = children.start(ring_idle_consumer, spec)
    _result(results, "ring_idle_consumer ready")
    time.sleep(seconds)
    with RingWriter(spec) as writer:
        uvloop.run(asyncio.wait_for(writer.send(b"wake up"), timeout=JOIN_TIMEOUT_S))
    cpu_pct = float(_result(results, "ring_idle_consumer")["cpu_pct"])
    children.join()
    return cpu_pct


def measure(args: argparse.Namespace) -> dict[str, Any]:
    n, batch, rounds, warmup = (
        args.messages,
        args.batch,
        args.round_trips + args.warmup,
        args.warmup,
    )
    children = Children()
    sockets = tempfile.mkdtemp(prefix="engine-ipc-bench-")
    prefix = run_prefix()
    specs = [RingSpec(f"{prefix}{name}", args.ring_capacity) for name in ("stream", "ping", "pong")]
    stream, ping, pong = specs
    rates: dict[str, list[float]] = {"ring": [], "ring_unbatched": [], "zmq": [], "queue": []}
    rtts: dict[str, list[tuple[float, float]]] = {"ring": [], "zmq": [], "queue": []}
    load_before = os.getloadavg()[0]
    try:
        for spec in specs:
            create_ring(spec)
        for trial in range(args.repeat):  # interleaved, so load changes hit every transport
            rates["ring"].append(
                one_way(children, (ring_consumer, stream, n), (ring_producer, stream, n, batch), n)
            )
            rates["ring_unbatched"].append(
                one_way(children, (ring_consumer, stream, n), (ring_producer, stream, n, 1), n)
            )
            address = f"ipc://{sockets}/stream-{trial}"
            rates["zmq"].append(
                one_way(children, (zmq_consumer, address, n), (zmq_producer, address, n), n)
            )
            queue = children.queue()
            rates["queue"].append(
                one_way(children, (queue_consumer, queue, n), (queue_producer, queue, n), n)
            )
            rtts["ring"].append(
                round_trips(
                    children,
                    (ring_ponger, ping, pong, rounds),
                    (ring_pinger, ping, pong, rounds),
                    warmup,
                )
            )
            zmq_ping, zmq_pong = f"ipc://{sockets}/ping-{trial}", f"ipc://{sockets}/pong-{trial}"
            rtts["zmq"].append(
                round_trips(
                    children,
                    (zmq_ponger, zmq_ping, zmq_pong, rounds),
                    (zmq_pinger, zmq_ping, zmq_pong, rounds),
                    warmup,
                )
            )
            queues = (children.queue(), children.queue())
            rtts["queue"].append(
                round_trips(
                    children,
                    (queue_ponger, *queues, rounds),
                    (queue_pinger, *queues, rounds),
                    warmup,
                )
            )
        idle = idle_cpu(children, stream, args.idle_seconds)
    finally:
        children.kill()
        for spec in specs:
            destroy_ring(spec)
        shutil.rmtree(sockets, ignore_errors=True)
    rate = {name: statistics.median(values) for name, values in rates.items()}
    p50 = {name: statistics.median(p for p, _ in values) for name, values in rtts.items()}
    p99 = {name: statistics.median(p for _, p in values) for name, values in rtts.items()}
    return {
        "ring_msgs_per_s": rate["ring"],
        "zmq_msgs_per_s": rate["zmq"],
        "queue_msgs_per_s": rate["queue"],
        "ring_unbatched_msgs_per_s": rate["ring_unbatched"],
        "ring_rtt_p50_us": p50["ring"],
        "ring_rtt_p99_us": p99["ring"],
        "zmq_rtt_p50_us": p50["zmq"],
        "zmq_rtt_p99_us": p99["zmq"],
        "queue_rtt_p50_us": p50["queue"],
        "queue_rtt_p99_us": p99["queue"],
        "ring_idle_cpu_pct": idle,
        "ring_vs_zmq_throughput": rate["ring"] / rate["zmq"],
        "zmq_vs_ring_rtt_p50": p50["zmq"] / p50["ring"],
        "trials": {"msgs_per_s": rates, "rtt_p50_p99_us": rtts},
        "message_bytes": len(ENCODER.encode(make_message())),
        "messages": n,
        "batch": batch,
        "ring_capacity": args.ring_capacity,
        "round_trips": args.round_trips,
        "repeat": args.repeat,
        "idle_seconds": args.idle_seconds,
        "load_average_1m_before": load_before,
        "load_average_1m_after": os.getloadavg()[0],
    }


def render_table(r: dict[str, Any]) -> str:
    rows = [
        (
            f"ring (batches of {r['batch']})",
            r["ring_msgs_per_s"],
            r["ring_rtt_p50_us"],
            r["ring_rtt_p99_us"],
        ),
        ("ring (one send per message)", r["ring_unbatched_msgs_per_s"], None, None),
        ("ZeroMQ ipc PUSH/PULL", r["zmq_msgs_per_s"], r["zmq_rtt_p50_us"], r["zmq_rtt_p99_us"]),
        (
            "multiprocessing.Queue",
            r["queue_msgs_per_s"],
            r["queue_rtt_p50_us"],
            r["queue_rtt_p99_us"],
        ),
    ]
    lines = [
        f"{r['message_bytes']}-byte msgspec message, {r['messages']:,} one-way messages "
        f"and {r['round_trips']:,} round trips per trial, medians of {r['repeat']} trials; "
        f"ring capacity {r['ring_capacity']:,} bytes",
        f"1-minute load average {r['load_average_1m_before']:.2f} before, "
        f"{r['load_average_1m_after']:.2f} after (other processes share these cores)",
        "",
        f"{'transport':<30} {'one-way msgs/s':>15} {'RTT p50 µs':>11} {'RTT p99 µs':>11}",
    ]
    for name, rate, p50, p99 in rows:
        p50_text = "" if p50 is None else f"{p50:.1f}"
        p99_text = "" if p99 is None else f"{p99:.1f}"
        lines.append(f"{name:<30} {rate:>15,.0f} {p50_text:>11} {p99_text:>11}")
    lines += [
        "",
        f"ring / ZeroMQ one-way:        {r['ring_vs_zmq_throughput']:.2f}x  (target >= 2.0x)",
        f"ZeroMQ / ring RTT p50:        {r['zmq_vs_ring_rtt_p50']:.2f}x  (target >= 3.0x)",
        f"parked ring consumer CPU over {r['idle_seconds']:.1f} s: "
        f"{r['ring_idle_cpu_pct']:.3f} %  (target <= 1 %)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=200_000, help="one-way messages per trial")
    parser.add_argument(
        "--ring-capacity", type=int, default=DEFAULT_RING_CAPACITY, help="ring data bytes"
    )
    parser.add_argument("--batch", type=int, default=64, help="frames per ring send_many")
    parser.add_argument(
        "--repeat", type=int, default=3, help="one-way trials per transport (median)"
    )
    parser.add_argument("--round-trips", type=int, default=5_000, help="timed ping-pongs")
    parser.add_argument("--warmup", type=int, default=500, help="untimed ping-pongs first")
    parser.add_argument("--idle-seconds", type=float, default=2.0, help="parked consumer window")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    for flag in ("messages", "batch", "repeat", "round_trips"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0 or args.idle_seconds <= 0:
        parser.error("--warmup must be >= 0 and --idle-seconds > 0")
    results = measure(args)
    print(json.dumps(results) if args.json else render_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
