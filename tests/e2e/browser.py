"""A real headless Chromium for the chat page (GET /), driven by Selenium with the system's
browser and driver (Debian's chromium and chromium-driver, installed by the Makefile's set-up):
Selenium's own manager is never asked to download anything.

`ChatPage` is what a person does on the page: give the API key, change the settings, send a
message, stop an answer, read what the page shows and what it stored.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WAIT_S = 30.0
# Flags that keep a headless Chromium in a container to itself: no sandbox (root), no GPU, and
# nothing fetched from outside (updates, sync, field trials).
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


def chromium_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            return f"{path} is missing (apt-get install chromium chromium-driver; make venv does)"
    return None


@contextmanager
def headless_chromium(profile: Path, width: int = 1200, height: int = 800) -> Iterator[Any]:
    """A Chromium with a fresh profile in `profile`, quit (browser and driver) on leaving."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()  # stops Chromium, then the chromedriver process Service started
        shutil.rmtree(profile, ignore_errors=True)


class ChatPage:
    """The chat page in `driver`, as a person uses it."""

    def __init__(self, driver: Any, url: str) -> None:
        self.driver = driver
        self.url = url

    def open(self, api_key: str | None) -> None:
        """Load the page; give the key when it asks for one; wait until the model is known."""
        self.driver.get(self.url + "/")
        if api_key is not None:
            self.wait(lambda: self.js("return document.getElementById('key-dialog').open"))
            self.element("#key-input").send_keys(api_key + "\n")
        self.wait_ready()

    def wait_ready(self) -> None:
        self.wait(lambda: self.js("return document.body.dataset.ready === 'true'"))

    def set_settings(self, **fields: str) -> None:
        """Settings by their input's id suffix: system, temperature, top-p, max-tokens, extra."""
        self.element("#open-settings").click()
        for name, value in fields.items():
            box = self.element(f"#set-{name.replace('_', '-')}")
            box.clear()
            box.send_keys(value)
        self.element("#settings-save").click()
        self.wait(lambda: not self.js("return document.getElementById('settings').open"))

    def send(self, text: str) -> None:
        """Type and send a message; return once its answer is on the page (a quick answer,
        or a refusal, may already have ended by then)."""
        answers = "return document.querySelectorAll('.msg.assistant').length"
        before = self.js(answers)
        self.element("#prompt").send_keys(text + "\n")
        self.wait(lambda: self.js(answers) > before)

    def last_answer(self) -> Any:
        return self.driver.find_elements("css selector", ".msg.assistant")[-1]

    def wait_answer_state(self, *states: str) -> Any:
        """The last answer once its data-state is one of `states`."""
        return self.wait(
            lambda: self.last_answer().get_attribute("data-state") in states and self.last_answer()
        )

    def wait_deltas(self, count: int) -> int:
        """Wait until the streaming answer has taken in `count` deltas; how many it has."""

        def deltas() -> int:
            return int(self.last_answer().get_attribute("data-deltas") or 0)

        return int(self.wait(lambda: deltas() >= count and deltas(), poll=0.01))

    def stop_after_deltas(self, count: int) -> dict[str, Any]:
        """Click Stop from inside the page the moment the streaming answer has taken in `count`
        deltas (a round trip per poll from here could miss a fast answer's end); what the
        answer showed then: its state, deltas and text."""
        script = """
            const [count, done] = [arguments[0], arguments[arguments.length - 1]];
            const answers = document.querySelectorAll('.msg.assistant');
            const answer = answers[answers.length - 1];
            const check = () => {
              if (Number(answer.dataset.deltas) < count && answer.dataset.state === 'streaming') {
                return false;
              }
              const seen = {state: answer.dataset.state, deltas: Number(answer.dataset.deltas),
                            text: answer.querySelector('.body').textContent};
              document.getElementById('stop').click();
              done(seen);
              return true;
            };
            if (!check()) {
              const watch = new MutationObserver(() => check() && watch.disconnect());
              const filter = ['data-deltas', 'data-state'];
              watch.observe(answer, {attributes: true, attributeFilter: filter});
            }
        """
        self.driver.set_script_timeout(WAIT_S)
        return dict(self.driver.execute_async_script(script, count))

    def stored_chats(self) -> list[dict[str, Any]]:
        return list(self.js("return JSON.parse(localStorage.getItem('engine-chat.chats'))") or [])

    def history_titles(self) -> list[str]:
        return [b.text for b in self.driver.find_elements("css selector", "#history .open-chat")]

    def severe_log(self) -> list[dict[str, Any]]:
        """The browser console's errors (uncaught exceptions, failed loads) since last read."""
        return [e for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]

    def element(self, selector: str) -> Any:
        return self.driver.find_element("css selector", selector)

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def wait(self, predicate: Any, timeout: float = WAIT_S, poll: float = 0.05) -> Any:
        from selenium.common.exceptions import StaleElementReferenceException

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                value = predicate()
            except StaleElementReferenceException:  # re-rendered between find and read
                value = None
            if value:
                return value
            time.sleep(poll)
        raise AssertionError(f"the chat page did not get there within {timeout} s")
