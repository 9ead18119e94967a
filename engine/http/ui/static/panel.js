// The live panel: the models loaded (when there are several), the engine's actors, restarts, requests in flight and KV cache usage, read
// from ui/state every second while the page is visible, so a person can watch an actor be
// killed and restarted while an answer keeps streaming.
"use strict";

(function () {
  const POLL_MS = 1000;
  const $ = (id) => document.getElementById(id);

  function showStatus(figures) {
    const status = $("live-status");
    let text = "ready";
    if (figures.failure) text = "failed";
    else if (figures.draining) text = "draining";
    else if (!figures.ready) text = "restarting";
    status.textContent = text;
    status.dataset.status = text;
    status.title = figures.failure || figures.not_ready.join(", ");
  }

  function showActors(actors) {
    const list = $("actors");
    list.replaceChildren(...actors.map((actor) => {
      const item = document.createElement("li");
      item.dataset.state = actor.state;
      const name = document.createElement("span");
      name.className = "actor-name";
      name.textContent = actor.name;
      const detail = document.createElement("span");
      detail.className = "actor-detail";
      const restarts = actor.restarts ? ` · ${actor.restarts}↻` : "";
      detail.textContent = `${actor.state}${actor.pid ? " · pid " + actor.pid : ""}${restarts}`;
      item.append(name, detail);
      return item;
    }));
  }

  // Each model that is not unloaded (loading, loaded, unloading, failed): its state, memory
  // (weights + KV cache) and requests in flight; listed only when the server has several.
  function showModels(models) {
    const list = $("live-models");
    const shown = (models || []).filter((model) => model.state !== "unloaded");
    list.hidden = !models || models.length < 2;
    list.replaceChildren(...shown.map((model) => {
      const item = document.createElement("li");
      item.dataset.state = model.state;
      const name = document.createElement("span");
      name.className = "model-name";
      name.textContent = model.name;
      const detail = document.createElement("span");
      const memory = model.memory_bytes ? ` · ${(model.memory_bytes / 2 ** 20).toFixed(0)} MiB` : "";
      const busy = model.in_flight ? ` · ${model.in_flight} in flight` : "";
      detail.textContent = `${model.state}${memory}${busy}`;
      detail.title = model.error || "";
      item.append(name, detail);
      return item;
    }));
  }

  function show(figures) {
    showStatus(figures);
    $("live-in-flight").textContent = figures.in_flight;
    $("live-running").textContent = `${figures.running} / ${figures.waiting}`;
    $("live-kv").textContent =
      `${(figures.kv_usage * 100).toFixed(1)}% of ${figures.kv_cache_blocks} blocks`;
    $("live-kv-meter").value = figures.kv_usage;
    $("live-restarts").textContent = figures.restarts +
      (figures.resubmitted_requests ? ` (${figures.resubmitted_requests} resubmitted)` : "");
    showModels(figures.models);
    showActors(figures.actors);
    if (figures.models && window.chatModels) {
      window.chatModels.showModelStates(figures.models, $("model-picker").value || figures.model);
    }
  }

  function startLivePanel(apiKey) {
    let timer = null;
    async function poll() {
      timer = null;
      if (document.visibilityState === "visible") {
        try {
          show(await window.chatApi.getJson("ui/state", apiKey()));
        } catch (e) {
          $("live-status").textContent = e.status === 401 ? "no key" : "unreachable";
          $("live-status").dataset.status = "failed";
        }
      }
      timer = setTimeout(poll, POLL_MS);
    }
    poll();
    return () => { if (timer !== null) clearTimeout(timer); };
  }

  window.startLivePanel = startLivePanel;
})();
