"""What a started server costs when nobody sends it anything: CPU of its whole process tree.

    python tools/bench/idle_cpu.py                                   # the default model, colocated
    python tools/bench/idle_cpu.py --engine-args='--prefill-replicas 1 --decode-replicas 1'

Starts `python -m engine` on a free port, waits --settle seconds after its ready line, then
samples user + system CPU time of the server and every process under it over --seconds, and
prints the total as a share of one core, with each process's part.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.client.servers import engine_server


def process_tree(root: int) -> dict[int, str]:
    """`root` and its descendants: pid -> command line."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError):
            continue
    tree = {root}
    grew = True
    while grew:
        new = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= new
        grew = bool(new)
    return {pid: _command(pid) for pid in tree}


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:70]
    except OSError:
        return "?"


def server_pid(url: str) -> int:
    """The pid listening on the URL's port (the server's root process)."""
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
            inodes.add(fields[9])
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if os.readlink(fd).removeprefix("socket:[").rstrip("]") in inodes:
                    return int(fd_dir.parent.name)
        except OSError:
            continue
    raise SystemExit(f"idle_cpu: no process listens on {url}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        help="checkpoint directory, .gguf file or 'demo' (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--engine-args", default="", help="more flags for `python -m engine`")
    p.add_argument("--settle", type=float, default=10.0, help="seconds after ready, first")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds sampled")
    args = p.parse_args()
    from engine.launch.model_source import model_directory
    from engine.settings.home import default_engine_home

    model, _ = model_directory(args.model, default_engine_home())
    logs = Path(tempfile.mkdtemp(prefix="idle-cpu-"))
    with engine_server(model, logs, shlex.split(args.engine_args), 600.0) as url:
        time.sleep(args.settle)
        tree = process_tree(server_pid(url))
        before = {pid: cpu_seconds(pid) for pid in tree}
        time.sleep(args.seconds)
        used = {pid: cpu_seconds(pid) - before[pid] for pid in tree}
    total = sum(used.values()) / args.seconds * 100
    print(
        f"idle: {total:.2f} % of one core in total, {len(tree)} processes, "
        f"{args.seconds:g} s sampled; {args.engine_args or 'default flags'}"
    )
    for pid, seconds in sorted(used.items(), key=lambda item: -item[1]):
        print(f"  {seconds / args.seconds * 100:5.2f} %  {pid}  {tree[pid]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
