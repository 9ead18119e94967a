"""The chat page on a real model: screenshots for docs/serving.md and the page's time to first token
against the server's.

Starts `python -m engine` (the default model unless --model), opens the page in a headless
Chromium (tests/e2e/browser.py), and:

1. sends --runs short messages one at a time; for each, the time to first token the page shows
   (fetch sent to first delta read, in the browser) beside the server's own figure for that
   request (the growth of engine:time_to_first_token_seconds_sum: arrival to first token);
2. asks for code and saves docs/chat_page.png;
3. kills the worker while a long answer streams, saves docs/chat_page_restart.png once the live
   panel shows the restart, and checks the answer then ends whole;
4. saves docs/chat_page_phone.png in a phone-sized window.

    python tests/e2e/chat_page_shots.py [--model PATH] [--runs 5] [--out docs]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.e2e.browser import ChatPage, chromium_missing, headless_chromium
from tests.e2e.harness import Server, served, wait_until

REPO = Path(__file__).resolve().parents[2]
CODE_PROMPT = "Write a Python function that tells whether a number is prime, then explain it."
LONG_PROMPT = "Tell me a long story about a lighthouse keeper."
SHORT_PROMPTS = ("Hello!", "What is 2 + 2?", "Name a colour.", "Say hi.", "Name a fruit.")


def server_ttft_sum(server: Server) -> tuple[float, float]:
    """(sum, count) of the server's time-to-first-token histogram."""
    with server.http() as http:
        text = http.get("/metrics").text
    figures = {}
    for part in ("sum", "count"):
        match = re.search(
            rf"^engine:time_to_first_token_seconds_{part}\{{[^}}]*\}} (\S+)$", text, re.M
        )
        figures[part] = float(match[1]) if match else 0.0
    return figures["sum"], figures["count"]


def measure_ttft(server: Server, page: ChatPage, runs: int) -> list[tuple[float, float]]:
    """(page's TTFT, server's TTFT) in ms for `runs` messages sent one at a time."""
    page.set_settings(temperature="0", max_tokens="16", extra="")
    pairs = []
    for i in range(runs):
        before_sum, before_count = server_ttft_sum(server)
        page.send(SHORT_PROMPTS[i % len(SHORT_PROMPTS)])
        answer = page.wait_answer_state("done", "error", "stopped")
        after_sum, after_count = wait_until(
            lambda b=before_count: (f := server_ttft_sum(server))[1] > b and f, timeout=30
        )
        assert after_count == before_count + 1, "another request ran beside the measurement"
        pairs.append((float(answer.get_attribute("data-ttft-ms")), (after_sum - before_sum) * 1e3))
    return pairs


def report(pairs: list[tuple[float, float]]) -> None:
    print("run  page TTFT ms  server TTFT ms  page - server ms  page / server")
    for i, (page_ms, server_ms) in enumerate(pairs):
        print(
            f"{i:3d}  {page_ms:11.1f}  {server_ms:14.1f}  {page_ms - server_ms:16.1f}  "
            f"{page_ms / server_ms:13.2f}"
        )
    page_ms = statistics.median(p for p, _ in pairs)
    server_ms = statistics.median(s for _, s in pairs)
    gaps = statistics.median(p - s for p, s in pairs)
    print(f"median: page {page_ms:.1f} ms, server {server_ms:.1f} ms, page - server {gaps:.1f} ms")


def restart_mid_answer(server: Server, page: ChatPage, out: Path) -> None:
    """Kill worker0 while an answer streams; the panel shows it, the answer still ends whole."""
    page.element("#new-chat").click()
    page.set_settings(temperature="0", max_tokens="200", extra='{"ignore_eos": true}')
    page.send(LONG_PROMPT)
    page.wait_deltas(20)
    worker = next(row for row in server.admin("actors") if row["name"] == "worker0")
    os.kill(worker["pid"], signal.SIGKILL)  # one of this server's actors, by its pid
    page.wait(lambda: page.element("#live-restarts").text.startswith("1"), timeout=60)
    page.driver.save_screenshot(str(out / "chat_page_restart.png"))
    answer = page.wait_answer_state("done", "error", "stopped")
    stored = page.stored_chats()[0]["messages"][-1]
    print(
        f"answer across the worker's restart: {answer.get_attribute('data-state')}, "
        f"{stored['tokens']} of 200 tokens"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model to serve (default: the engine's default model)")
    parser.add_argument("--runs", type=int, default=5, help="messages timed one at a time")
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="where the PNGs go")
    args = parser.parse_args()
    if (missing := chromium_missing()) is not None:
        print(f"chat_page_shots: {missing}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        flags = ["--host", "127.0.0.1", "--port", "0", "--admin.socket", f"{work}/admin.sock"]
        flags += ["--model", args.model] if args.model else []
        with served(flags, Path(work), name="chat-page") as server:
            run(server, args, Path(work))
    return 0


def run(server: Server, args: Any, work: Path) -> None:
    with headless_chromium(work / "profile", width=1280, height=1000) as driver:
        page = ChatPage(driver, server.url)
        page.open(api_key=None)
        report(measure_ttft(server, page, args.runs))
        page.element("#new-chat").click()
        page.set_settings(temperature="0", max_tokens="400", extra="")
        page.send(CODE_PROMPT)
        page.wait_answer_state("done", "error", "stopped")
        page.driver.save_screenshot(str(args.out / "chat_page.png"))
        restart_mid_answer(server, page, args.out)
        page.driver.find_elements("css selector", "#history .open-chat")[1].click()
        page.driver.set_window_size(390, 844)
        page.wait(lambda: page.js("return window.innerWidth") <= 390)
        sidebar_right = "return document.getElementById('sidebar').getBoundingClientRect().right"
        page.wait(lambda: page.js(sidebar_right) <= 0)  # folded away, its transition over
        page.driver.save_screenshot(str(args.out / "chat_page_phone.png"))
        errors = page.severe_log()
        print(f"console errors: {errors or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
