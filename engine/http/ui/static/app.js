// The chat page: conversation, streaming, stop, history, settings and the API key.
"use strict";

(function () {
  const store = window.chatStore;
  const api = window.chatApi;
  const $ = (id) => document.getElementById(id);
  let modelName = "";
  let keyRequired = false;
  let active = null; // the answer streaming now: {controller, reply, element}

  // ---- one message ------------------------------------------------------------------------------
  // A model whose server has no reasoning parser writes its reasoning inline, in <think>.
  function splitThink(content) {
    const m = content.match(/^\s*<think>([\s\S]*?)(?:<\/think>|$)([\s\S]*)$/);
    return m ? [m[1], m[2]] : ["", content];
  }

  function statsLine(reply) {
    if (reply.state === "streaming" && reply.ttft_ms === undefined) {
      // The load indicator: a model not loaded yet is loaded before its first token.
      const state = window.chatModels.modelState(modelName);
      return state === "loaded" ? "…" : `loading ${modelName}…`;
    }
    const parts = [reply.model || modelName];
    if (reply.ttft_ms !== undefined && reply.ttft_ms !== null) {
      parts.push(`TTFT ${Math.round(reply.ttft_ms)} ms`);
    }
    if (reply.tps) parts.push(`${reply.tps.toFixed(1)} tok/s`);
    if (reply.tokens) parts.push(`${reply.tokens} tokens`);
    if (reply.state === "stopped") parts.push("stopped");
    if (reply.finish === "length") parts.push("cut at max tokens");
    return parts.join(" · ");
  }

  function fillAnswer(body, reply) {
    const [inlineThought, answer] = splitThink(reply.content);
    const reasoning = (reply.reasoning || "") + inlineThought;
    const wasOpen = body.querySelector("details.reasoning")?.open;
    let html = "";
    if (reasoning) {
      const label = answer || reply.state !== "streaming" ? "Reasoning" : "Thinking…";
      html += `<details class="reasoning"${wasOpen ? " open" : ""}><summary>${label}</summary>` +
        `<div class="reasoning-body">${window.renderMarkdown(reasoning)}</div></details>`;
    }
    html += window.renderMarkdown(answer);
    if (reply.error) html += `<p class="error">${window.escapeHtml(reply.error)}</p>`;
    body.innerHTML = html;
  }

  function fill(element, message) {
    element.dataset.state = message.state || "done";
    const body = element.querySelector(".body");
    if (message.role === "user") {
      body.textContent = message.content;
      return;
    }
    fillAnswer(body, message);
    element.dataset.deltas = message.deltas || 0;
    if (message.ttft_ms !== undefined && message.ttft_ms !== null) {
      element.dataset.ttftMs = message.ttft_ms.toFixed(1);
    }
    element.querySelector(".stats").textContent = statsLine(message);
  }

  function messageElement(message) {
    const element = document.createElement("div");
    element.className = "msg " + message.role;
    const body = document.createElement("div");
    body.className = "body";
    element.append(body);
    if (message.role === "assistant") {
      const stats = document.createElement("div");
      stats.className = "stats";
      element.append(stats);
    }
    fill(element, message);
    return element;
  }

  // ---- the chat and its history ----------------------------------------------------------------
  function renderChat() {
    const chat = store.current();
    const list = $("messages");
    if (!chat || chat.messages.length === 0) {
      const empty = document.createElement("p");
      empty.className = "empty";
      empty.textContent = modelName ? `Ask ${modelName} anything.` : "Ask anything.";
      list.replaceChildren(empty);
      return;
    }
    list.replaceChildren(...chat.messages.map((message) => {
      const element = messageElement(message);
      if (active && message === active.reply) active.element = element;
      return element;
    }));
    list.scrollTop = list.scrollHeight;
  }

  function renderHistory() {
    $("history").replaceChildren(...store.chats.map((chat) => {
      const item = document.createElement("li");
      if (chat.id === store.currentId) item.setAttribute("aria-current", "true");
      const open = document.createElement("button");
      open.type = "button";
      open.className = "open-chat";
      open.textContent = chat.title;
      open.addEventListener("click", () => { store.select(chat.id); showChat(); });
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "delete-chat";
      remove.setAttribute("aria-label", "Delete chat " + chat.title);
      remove.textContent = "×";
      remove.addEventListener("click", () => { store.remove(chat.id); showChat(); });
      item.append(open, remove);
      return item;
    }));
  }

  function showChat() {
    renderHistory();
    renderChat();
    showSidebar(false);
  }

  // On a narrow screen the chat list slides over the page, with a backdrop behind it; ☰, a tap
  // on the backdrop or Escape closes it.
  const sidebarShown = () => $("layout").classList.contains("show-sidebar");
  function showSidebar(shown) {
    $("layout").classList.toggle("show-sidebar", shown);
    $("toggle-sidebar").setAttribute("aria-expanded", String(shown));
    $("toggle-sidebar").setAttribute("aria-label", shown ? "Hide chats" : "Show chats");
  }

  // ---- sending and stopping ----------------------------------------------------------------------
  function requestBody(chat) {
    const settings = store.settings;
    const messages = [];
    if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
    for (const m of chat.messages) {
      if (m.state === "streaming" || m.error) continue;
      messages.push({ role: m.role, content: m.role === "user" ? m.content : splitThink(m.content)[1] });
    }
    const extra = settings.extra.trim() ? JSON.parse(settings.extra) : {};
    const chosen = {};  // what the person set; the rest is the server's default
    for (const name of ["temperature", "top_p", "max_tokens"]) {
      if (settings[name] !== null && settings[name] !== undefined) chosen[name] = settings[name];
    }
    return { model: modelName, messages, ...chosen, ...extra };
  }

  let renderQueued = false;
  function scheduleRender() {
    if (renderQueued) return;
    renderQueued = true;
    requestAnimationFrame(() => {
      renderQueued = false;
      if (!active || !active.element.isConnected) return;
      const list = $("messages");
      const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
      fill(active.element, active.reply);
      if (atBottom) list.scrollTop = list.scrollHeight;
    });
  }

  function take(reply, chunk, timing) {
    if (chunk.usage) reply.tokens = chunk.usage.completion_tokens;
    if (chunk.model) reply.model = chunk.model;
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) return;
    if (choice.finish_reason) reply.finish = choice.finish_reason;
    const delta = choice.delta || {};
    if (!delta.content && !delta.reasoning_content) return;
    const now = performance.now();
    if (timing.first === null) {
      timing.first = now;
      reply.ttft_ms = now - timing.started;
    }
    timing.last = now;
    reply.content += delta.content || "";
    reply.reasoning += delta.reasoning_content || "";
    reply.deltas += 1;
    scheduleRender();
  }

  function finish(reply, timing) {
    reply.tokens = reply.tokens || reply.deltas;
    const decodeSeconds = (timing.last - timing.first) / 1000;
    reply.tps = reply.tokens > 1 && decodeSeconds > 0 ? (reply.tokens - 1) / decodeSeconds : null;
    if (reply.ttft_ms === undefined) reply.ttft_ms = null;
  }

  async function send(text) {
    const chat = store.current() || store.newChat();
    if (chat.messages.length === 0) chat.title = text.slice(0, 60);
    chat.messages.push({ role: "user", content: text });
    const reply = { role: "assistant", content: "", reasoning: "", state: "streaming", deltas: 0 };
    const body = requestBody(chat);
    chat.messages.push(reply);
    active = { controller: new AbortController(), reply, element: null };
    store.save();
    showChat();
    setBusy(true);
    const timing = { started: performance.now(), first: null, last: null };
    try {
      await api.streamChat(body, store.apiKey(), active.controller.signal,
        (chunk) => take(reply, chunk, timing));
      reply.state = "done";
    } catch (e) {
      if (e.name === "AbortError") {
        reply.state = "stopped";
      } else {
        reply.state = "error";
        reply.error = e.message;
      }
      if (e.status === 401) askForKey("The server refused the API key; enter it again.");
    } finally {
      finish(reply, timing);
      const element = active.element;
      active = null;
      if (element && element.isConnected) fill(element, reply);
      store.save();
      setBusy(false);
    }
  }

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    document.body.dataset.busy = busy ? "true" : "false";
  }

  // ---- settings and the API key ----------------------------------------------------------------
  function openSettings() {
    const s = store.settings;
    $("set-system").value = s.system;
    $("set-temperature").value = s.temperature ?? "";
    $("set-top-p").value = s.top_p ?? "";
    $("set-max-tokens").value = s.max_tokens ?? "";
    $("set-extra").value = s.extra;
    $("settings-error").textContent = "";
    $("forget-key").hidden = !store.apiKey();  // only where there is one to forget
    $("settings").showModal();
  }

  function readSettings() {
    const number = (id, name, low, high) => {
      if ($(id).value.trim() === "") return null;  // the server's default
      const value = Number($(id).value);
      if (!(value >= low && value <= high)) {
        throw new Error(`${name} must be a number from ${low} to ${high}, or empty`);
      }
      return value;
    };
    const maxTokens = number("set-max-tokens", "Max tokens", 1, 1e9);
    if (maxTokens !== null && !Number.isInteger(maxTokens)) {
      throw new Error("Max tokens must be a whole number");
    }
    const extra = $("set-extra").value.trim();
    if (extra) {
      let parsed;
      try { parsed = JSON.parse(extra); } catch (e) {
        throw new Error("Extra request fields are not valid JSON: " + e.message);
      }
      if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
        throw new Error("Extra request fields must be a JSON object, like {\"top_k\": 20}");
      }
    }
    return {
      system: $("set-system").value,
      temperature: number("set-temperature", "Temperature", 0, 2),
      top_p: number("set-top-p", "Top-p", 0, 1),
      max_tokens: maxTokens,
      extra,
    };
  }

  function saveSettings(event) {
    event.preventDefault();
    try {
      store.saveSettings({ ...readSettings(), model: store.settings.model });
      $("settings").close();
    } catch (e) {
      $("settings-error").textContent = e.message;
    }
  }

  let keyWaiters = [];
  function askForKey(message) {
    $("key-error").textContent = message;
    $("key-input").value = "";
    if (!$("key-dialog").open) $("key-dialog").showModal();
    return new Promise((resolve) => keyWaiters.push(resolve));
  }

  function saveKey(event) {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) {
      $("key-error").textContent = "Enter the server's API key.";
      return;
    }
    store.setApiKey(key);
    $("key-dialog").close();
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((resolve) => resolve());
  }

  async function loadModel() {
    for (;;) {
      try {
        const models = await api.getJson("v1/models", store.apiKey());
        modelName = store.settings.model || models.data[0].id;
        if (!models.data.some((card) => card.id === modelName)) modelName = models.data[0].id;
        $("model-name").textContent = modelName;
        window.chatModels.showModelCards(models.data, modelName);
        return;
      } catch (e) {
        if (e.status !== 401) {
          $("model-name").textContent = "server unreachable: " + e.message;
          return;
        }
        await askForKey("The server refused the API key; enter it again.");
      }
    }
  }

  // ---- wiring ------------------------------------------------------------------------------------
  async function copyText(text) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (e) { // no clipboard API (a page not served over https or localhost)
      const area = document.createElement("textarea");
      area.value = text;
      document.body.append(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
  }

  function onMessagesClick(event) {
    const button = event.target.closest("button.copy");
    if (!button) return;
    const code = button.closest(".code-block").querySelector("code").textContent;
    copyText(code).then(() => {
      button.textContent = "Copied";
      setTimeout(() => { button.textContent = "Copy"; }, 1500);
    });
  }

  function submitPrompt(event) {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || active || !modelName) return;
    $("prompt").value = "";
    growPrompt();
    send(text);
  }

  function growPrompt() {
    const prompt = $("prompt");
    prompt.style.height = "auto";
    prompt.style.height = Math.min(prompt.scrollHeight, 200) + "px";
  }

  function bind() {
    $("composer").addEventListener("submit", submitPrompt);
    $("model-picker").addEventListener("change", (event) => {
      modelName = event.target.value;
      store.saveSettings({ ...store.settings, model: modelName });
      $("model-name").textContent = modelName;
      renderChat();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) submitPrompt(event);
    });
    $("prompt").addEventListener("input", growPrompt);
    $("stop").addEventListener("click", () => active && active.controller.abort());
    $("new-chat").addEventListener("click", () => {
      if (!active) { store.newChat(); showChat(); $("prompt").focus(); }
    });
    $("toggle-sidebar").addEventListener("click", () => showSidebar(!sidebarShown()));
    $("backdrop").addEventListener("click", () => showSidebar(false));
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && sidebarShown()) showSidebar(false);
    });
    const narrow = window.matchMedia("(max-width: 700px)");
    const fitPlaceholder = () => {
      $("prompt").placeholder = narrow.matches ? "Message" : "Send a message (Shift+Enter: new line)";
    };
    narrow.addEventListener("change", fitPlaceholder);
    fitPlaceholder();
    $("messages").addEventListener("click", onMessagesClick);
    $("open-settings").addEventListener("click", openSettings);
    $("settings-form").addEventListener("submit", saveSettings);
    $("settings-cancel").addEventListener("click", () => $("settings").close());
    $("forget-key").addEventListener("click", () => {
      store.setApiKey("");
      $("settings").close();
      if (keyRequired) askForKey("");
    });
    $("key-form").addEventListener("submit", saveKey);
    $("key-dialog").addEventListener("cancel", (event) => event.preventDefault());
  }

  async function start() {
    bind();
    showChat();
    try {
      keyRequired = (await api.getJson("ui/info", "")).api_key_required;
    } catch (e) {
      $("model-name").textContent = "server unreachable: " + e.message;
      return;
    }
    if (keyRequired && !store.apiKey()) await askForKey("");
    await loadModel();
    renderChat();
    window.startLivePanel(() => store.apiKey());
    document.body.dataset.ready = "true";
  }

  start();
})();
