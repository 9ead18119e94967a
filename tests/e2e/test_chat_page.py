"""The chat page (GET /) in a real headless Chromium, against the shared e2e server (the tiny
test model, an API key set). One browser session for the whole module.

What a person does: gives the key once, sends a message and sees the answer stream in (the
same text the API gives), stops a long answer mid-way (the server counts the request aborted
and holds nothing of it), reloads and finds both chats, watches the live panel list the
engine's actors, and uses the page in a phone-sized window; the console shows no error.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.keys import Keys

from tests.e2e.browser import ChatPage, chromium_missing, headless_chromium
from tests.e2e.harness import API_KEY, Server, wait_until
from tests.holds import HOLD_TEXT

pytestmark = pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing()))

SHORT_TOKENS = 24
LONG_TOKENS = 960  # the shared server's max_model_len is 1024: the prompt fits beside it
# Held (tests/holds.py): its answer streams for 19 s on any machine, so Stop comes mid-answer.
LONG_PROMPT = "Tell me a long story." + HOLD_TEXT
PHONE = (390, 844)
SYSTEM = "You answer in one line."


@pytest.fixture(scope="module")
def page(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChatPage]:
    """The page loaded in Chromium, its API key given once at the prompt it shows."""
    with headless_chromium(tmp_path_factory.mktemp("chromium")) as driver:
        chat_page = ChatPage(driver, server.url)
        chat_page.open(api_key=API_KEY)
        yield chat_page


def aborted_chats(server: Server) -> float:
    with server.http() as http:
        text = http.get("/metrics").text
    pattern = r"^engine:http_requests_total\{([^}]*)\} ([0-9.]+)$"
    for labels, value in re.findall(pattern, text, re.M):
        if 'endpoint="chat_completions"' in labels and 'outcome="aborted"' in labels:
            return float(value)
    return 0.0


def test_chat_page_in_chromium(server: Server, page: ChatPage) -> None:
    assert page.element("#model-name").text == server.model
    answer_streams_as_the_api_answers(server, page)
    stop_aborts_the_request_on_the_server(server, page)
    reload_finds_the_history(page)
    live_panel_lists_the_actors(server, page)
    refusals_are_shown(page)
    settings_offer_only_what_applies(page)
    fits_a_phone(page)
    assert page.severe_log() == []


def answer_streams_as_the_api_answers(server: Server, page: ChatPage) -> None:
    page.set_settings(
        system=SYSTEM, temperature="0", top_p="1", max_tokens=str(SHORT_TOKENS), extra=""
    )
    page.send("Hello there")
    answer = page.wait_answer_state("done", "error")
    assert answer.get_attribute("data-state") == "done", answer.text
    assert int(answer.get_attribute("data-deltas")) > 1  # it came in pieces, as they were made
    stats = answer.find_element("css selector", ".stats").text
    assert server.model in stats and "TTFT" in stats and "tok/s" in stats, stats
    request = {
        "model": server.model,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Hello there"},
        ],
        "temperature": 0,
        "top_p": 1,
        "max_tokens": SHORT_TOKENS,
    }
    with server.http() as http:
        expected = http.post("/v1/chat/completions", json=request).json()
    shown = page.stored_chats()[0]["messages"][-1]
    assert shown["content"] == expected["choices"][0]["message"]["content"]
    assert shown["tokens"] == expected["usage"]["completion_tokens"]


def stop_aborts_the_request_on_the_server(server: Server, page: ChatPage) -> None:
    aborted_before = aborted_chats(server)
    page.element("#new-chat").click()
    page.set_settings(max_tokens=str(LONG_TOKENS), extra='{"ignore_eos": true}')
    page.send(LONG_PROMPT)
    seen = page.stop_after_deltas(3)
    assert seen["state"] == "streaming" and seen["text"], seen  # on screen while it streamed
    answer = page.wait_answer_state("stopped", "done", "error")
    assert answer.get_attribute("data-state") == "stopped"
    assert "stopped" in answer.find_element("css selector", ".stats").text
    wait_until(lambda: aborted_chats(server) == aborted_before + 1, timeout=30)
    wait_until(lambda: not server.admin("requests") and server.admin("stats")["kv_usage"] == 0)
    stopped = page.stored_chats()[0]["messages"][-1]
    assert stopped["state"] == "stopped" and 0 < stopped["tokens"] < LONG_TOKENS
    assert page.element("#send").is_displayed() and not page.element("#stop").is_displayed()


def reload_finds_the_history(page: ChatPage) -> None:
    page.driver.refresh()
    page.wait_ready()
    assert not page.js("return document.getElementById('key-dialog').open")  # asked once
    assert page.history_titles() == [LONG_PROMPT, "Hello there"]
    assert page.last_answer().get_attribute("data-state") == "stopped"
    page.driver.find_elements("css selector", "#history .open-chat")[1].click()
    answer = page.wait_answer_state("done")
    assert page.element(".msg.user .body").text == "Hello there"
    assert "TTFT" in answer.find_element("css selector", ".stats").text


def live_panel_lists_the_actors(server: Server, page: ChatPage) -> None:
    actors = {row["name"] for row in server.admin("actors")}

    def shown() -> set[str]:
        return {e.text for e in page.driver.find_elements("css selector", "#actors .actor-name")}

    page.wait(lambda: shown() == actors)
    assert page.element("#live-status").text == "ready"
    assert page.element("#live-in-flight").text == "0"
    assert "blocks" in page.element("#live-kv").text


def refusals_are_shown(page: ChatPage) -> None:
    """A bad setting is refused in the dialog; a request the server refuses shows its error."""
    page.element("#open-settings").click()
    box = page.element("#set-temperature")
    box.clear()
    box.send_keys("5")
    page.element("#settings-save").click()
    error = page.element("#settings-error").text
    assert error == "Temperature must be a number from 0 to 2, or empty", error
    assert page.js("return document.getElementById('settings').open")
    page.element("#settings-cancel").click()
    page.element("#new-chat").click()
    page.set_settings(max_tokens="100000", extra="")  # past the server's max_model_len
    page.send("Hello")
    answer = page.wait_answer_state("error", "done", "stopped")
    assert answer.get_attribute("data-state") == "error"
    shown = answer.find_element("css selector", ".error").text
    assert shown.startswith("HTTP 400: ") and "max_tokens" in shown, shown
    page.severe_log()  # the console's line for the refused request: expected here


SIDEBAR_RIGHT = "return document.getElementById('sidebar').getBoundingClientRect().right"
SIDEBAR_LEFT = "return document.getElementById('sidebar').getBoundingClientRect().left"
# What a tap at the middle of an element would hit: the element itself, or what covers it.
TAP_HITS = """
    const box = arguments[0].getBoundingClientRect();
    const hit = document.elementFromPoint(box.left + box.width / 2, box.top + box.height / 2);
    return hit === arguments[0] || arguments[0].contains(hit);
"""
BESIDE_THE_LIST = "return document.elementFromPoint(innerWidth - 10, innerHeight / 2).id"
# The widest text the prompt shows without input, against the room its box gives it.
PLACEHOLDER_FITS = """
    const box = document.getElementById('prompt');
    const style = getComputedStyle(box);
    const context = document.createElement('canvas').getContext('2d');
    context.font = `${style.fontSize} ${style.fontFamily}`;
    const room = box.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    return context.measureText(box.placeholder).width <= room;
"""


def fits_a_phone(page: ChatPage) -> None:
    """In a phone-sized window the chat list folds away; ☰ opens it and stays in reach to
    close it, and so do a tap on the backdrop beside it and Escape; the prompt's placeholder
    fits its box."""
    page.driver.set_window_size(*PHONE)
    page.wait(lambda: page.js("return window.innerWidth") <= PHONE[0])
    assert page.js("return document.documentElement.scrollWidth <= window.innerWidth")
    assert page.element("#prompt").is_displayed() and page.element("#send").is_displayed()
    assert page.js(PLACEHOLDER_FITS), page.js(
        "return document.getElementById('prompt').placeholder"
    )
    page.wait(lambda: page.js(SIDEBAR_RIGHT) <= 0)  # folded away
    toggle = page.element("#toggle-sidebar")
    backdrop = page.element("#backdrop")
    for close in ("toggle", "escape", "backdrop", "choose a chat"):
        toggle.click()
        page.wait(lambda: page.js(SIDEBAR_LEFT) >= 0)  # all in view, its transition over
        assert toggle.get_attribute("aria-expanded") == "true"
        assert page.js(TAP_HITS, toggle), "the open chat list covers ☰"
        if close == "toggle":
            toggle.click()
        elif close == "escape":
            ActionChains(page.driver).send_keys(Keys.ESCAPE).perform()
        elif close == "backdrop":
            # Beside the open list, at the right edge: the backdrop is what a tap hits there.
            assert page.js(BESIDE_THE_LIST) == "backdrop"
            beside = backdrop.size["width"] // 2 - 10
            ActionChains(page.driver).move_to_element_with_offset(
                backdrop, beside, 0
            ).click().perform()
        else:
            page.driver.find_elements("css selector", "#history .open-chat")[0].click()
        page.wait(lambda: page.js(SIDEBAR_RIGHT) <= 0)  # folded again
        assert toggle.get_attribute("aria-expanded") == "false" and not backdrop.is_displayed()


def settings_offer_only_what_applies(page: ChatPage) -> None:
    """Forget API key shows only while a key is kept; empty sampling fields are left out of
    the request, for the server's defaults (its own or llama.cpp's, and its output bound)."""
    page.element("#open-settings").click()
    assert page.element("#forget-key").is_displayed()  # the key given when the page opened
    page.element("#settings-cancel").click()
    kept = page.js("return localStorage.getItem('engine-chat.key')")
    page.js("localStorage.removeItem('engine-chat.key')")
    page.element("#open-settings").click()
    assert not page.element("#forget-key").is_displayed()
    page.element("#settings-cancel").click()
    page.js("localStorage.setItem('engine-chat.key', arguments[0])", kept)
    page.set_settings(temperature="", top_p="", max_tokens="", extra="")
    sent = page.js("return JSON.parse(localStorage.getItem('engine-chat.settings'))")
    assert (sent["temperature"], sent["top_p"], sent["max_tokens"]) == (None, None, None)


MARKDOWN = """# Title

Some **bold**, *italic* and `inline <code>`.

```python
def greet(name):
    return "hi " + name  # a comment
```

- one
- two

1. loose, with blank lines

2. between its items

3. and one list

7) from seven
8) on

<script>window.injected = 1</script> [bad](javascript:window.injected=2) [good](https://example.org/a?b=1&c=2)
"""


def test_markdown_rendering_in_chromium(page: ChatPage) -> None:
    found: dict[str, Any] = page.js(
        """
        const box = document.createElement('div');
        box.innerHTML = renderMarkdown(arguments[0]);
        const links = [...box.querySelectorAll('a')];
        return {
          h1: box.querySelector('h1').textContent,
          strong: box.querySelector('strong').textContent,
          em: box.querySelector('em').textContent,
          inlineCode: box.querySelector('p code').textContent,
          language: box.querySelector('.code-head span').textContent,
          keywords: [...box.querySelectorAll('.tok-keyword')].map(e => e.textContent),
          strings: [...box.querySelectorAll('.tok-string')].map(e => e.textContent),
          comments: [...box.querySelectorAll('.tok-comment')].map(e => e.textContent),
          code: box.querySelector('pre code').textContent,
          copy: box.querySelectorAll('.code-block button.copy').length,
          items: [...box.querySelectorAll('li')].map(e => e.textContent),
          lists: [...box.querySelectorAll('ol, ul')]
            .map(l => [l.tagName, l.start, l.children.length]),
          looseItem: box.querySelector('ol li').innerHTML,
          scripts: box.querySelectorAll('script').length,
          links: links.map(a => [a.textContent, a.getAttribute('href'), a.rel]),
          text: box.textContent,
        };
        """,
        MARKDOWN,
    )
    assert found["h1"] == "Title" and found["strong"] == "bold" and found["em"] == "italic"
    assert found["inlineCode"] == "inline <code>"
    assert found["language"] == "python" and found["copy"] == 1
    assert found["keywords"] == ["def", "return"]
    assert found["strings"] == ['"hi "'] and found["comments"] == ["# a comment"]
    assert found["code"] == 'def greet(name):\n    return "hi " + name  # a comment'
    assert found["items"][:2] == ["one", "two"]
    # CommonMark: blank lines between items keep one (loose) list; a list keeps its first number
    assert found["lists"] == [["UL", None, 2], ["OL", 1, 3], ["OL", 7, 2]]
    assert found["looseItem"] == "<p>loose, with blank lines</p>"
    # An answer's markup is text: no element, no script link
    assert found["scripts"] == 0 and "<script>window.injected = 1</script>" in found["text"]
    assert found["links"] == [["good", "https://example.org/a?b=1&c=2", "noopener noreferrer"]]
    assert page.js("return window.injected") is None


def test_reasoning_is_folded_and_code_copies(page: ChatPage) -> None:
    """A stored answer with <think> reasoning and a code block, as the page shows it; an
    answer left streaming when the page closed shows as stopped."""
    chat = {
        "id": "folded",
        "title": "Reasoning",
        "created": 0,
        "messages": [
            {"role": "user", "content": "Why?"},
            {
                "role": "assistant",
                "content": "<think>Weigh it first.</think>Because:\n\n```sh\necho hi\n```",
                "reasoning": "",
                "state": "done",
                "deltas": 9,
                "tokens": 9,
                "ttft_ms": 12.5,
            },
            {"role": "user", "content": "And?"},
            # the page was closed while this one streamed
            {"role": "assistant", "content": "Part", "reasoning": "", "state": "streaming"},
        ],
    }
    page.js(
        "localStorage.setItem('engine-chat.chats', JSON.stringify([arguments[0]]));"
        "localStorage.setItem('engine-chat.current', JSON.stringify('folded'));",
        chat,
    )
    page.driver.refresh()
    page.wait_ready()
    interrupted = page.last_answer()
    assert interrupted.get_attribute("data-state") == "stopped"  # not streaming forever
    details = page.element(".msg.assistant details.reasoning")
    assert details.get_attribute("open") is None  # folded away
    assert details.find_element("css selector", "summary").text == "Reasoning"
    body = page.element(".msg.assistant .body > p").text
    assert body == "Because:"
    copy = page.element(".msg.assistant button.copy")
    copy.click()
    page.wait(lambda: copy.text == "Copied")
    assert page.severe_log() == []


def test_live_state_needs_the_key(server: Server) -> None:
    assert httpx.get(server.url + "/ui/state", timeout=30).status_code == 401
    with server.http() as http:
        figures = http.get("/ui/state").json()
    assert figures["model"] == server.model and figures["ready"] is True
    assert {a["name"] for a in figures["actors"]} == {a["name"] for a in server.admin("actors")}
