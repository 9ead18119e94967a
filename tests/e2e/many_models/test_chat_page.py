"""The chat page on a server of several models (issue 48, item 5): the picker lists every model of
the catalogue with its state; a message to a model that is not loaded loads it and is answered by
it; the live panel lists each loaded model with its memory, and every loaded model's actors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.support.ui import Select

from tests.e2e.browser import ChatPage, chromium_missing, headless_chromium
from tests.e2e.harness import API_KEY, Server
from tests.e2e.many_models.test_catalogue import LOADS_S, states

pytestmark = pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing()))


@pytest.fixture
def page(models: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChatPage]:
    with headless_chromium(tmp_path_factory.mktemp("chromium")) as driver:
        chat_page = ChatPage(driver, models.url)
        chat_page.open(api_key=API_KEY)
        yield chat_page


def test_the_page_picks_a_model_loads_it_and_shows_each_models_memory(
    models: Server, page: ChatPage
) -> None:
    # llama-q8 (a GGUF file): unloaded by test_catalogue's LRU test, shown by test_ollama_api's
    # (/api/show loads a model): loaded here, it is loaded once.
    with models.http() as http:
        assert http.post("/models/unload", json={"model": "llama-q8"}).status_code == 200
    before = states(models)

    def offered() -> dict[str, str]:  # read in one go: the panel re-renders the list each second
        script = "return [...document.querySelectorAll('#model-picker option')]"
        return dict(page.js(script + ".map((o) => [o.value, o.textContent])"))

    page.wait(lambda: set(offered()) == set(before))
    for name, state in before.items():
        assert offered()[name].startswith(f"{name} — {state}")

    page.wait(lambda: _pick(page, "llama-q8"))
    page.send("Hello")
    # the model's load comes first: as long as loads may take on a busy machine
    answer = page.wait(lambda: _answer_ended(page), timeout=LOADS_S)
    assert answer.get_attribute("data-state") == "done", answer.text
    assert states(models)["llama-q8"] == "loaded"  # loaded by the page's message
    assert "llama-q8" in answer.find_element("css selector", ".stats").text

    def shown_models() -> dict[str, str]:
        script = "return [...document.querySelectorAll('#live-models li')]"
        rows = page.js(script + ".map((li) => [li.firstChild.textContent, li.textContent])")
        return dict(rows)

    loaded = {name for name, state in states(models).items() if state == "loaded"}
    loaded -= {"llama:tiny"}  # an alias, not a model of its own
    page.wait(lambda: set(shown_models()) >= loaded, timeout=LOADS_S)
    for name in loaded:
        assert " MiB" in shown_models()[name], shown_models()[name]
    actors = {f"{row['model']}/{row['name']}" for row in models.admin("actors")}
    page.wait(
        lambda: (
            {e.text for e in page.driver.find_elements("css selector", "#actors .actor-name")}
            == actors
        )
    )
    assert page.severe_log() == []


def _answer_ended(page: ChatPage) -> Any:
    answer = page.last_answer()
    return answer.get_attribute("data-state") in ("done", "error") and answer


def _pick(page: ChatPage, name: str) -> bool:
    """Choose `name` in the picker as a click would (the panel may re-render it meanwhile)."""
    try:
        Select(page.element("#model-picker")).select_by_value(name)
    except StaleElementReferenceException:
        return False
    return bool(page.element("#model-name").text == name)
