// The model picker: every model the server knows (/v1/models: loaded or not), its state and
// memory, refreshed from the live panel's ui/state. Choosing a model that is not loaded is fine:
// the server loads it on the first message (the topbar says "loading" until its answer starts).
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const states = new Map(); // name -> {state, memory_bytes, error}

  function label(name) {
    const model = states.get(name);
    if (!model) return name;
    const memory = model.memory_bytes ? ` · ${(model.memory_bytes / 2 ** 20).toFixed(0)} MiB` : "";
    return `${name} — ${model.state}${memory}`;
  }

  function render(current) {
    const picker = $("model-picker");
    const names = [...states.keys()];
    picker.hidden = names.length < 2;
    picker.replaceChildren(...names.map((name) => {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = label(name);
      option.dataset.state = states.get(name).state;
      option.title = states.get(name).error || "";
      return option;
    }));
    picker.value = current;
  }

  // cards: /v1/models' data; adapters (no status) ride on their base model and are not listed
  function showModelCards(cards, current) {
    for (const card of cards) {
      if (card.status) states.set(card.id, { state: card.status.value, memory_bytes: card.status.memory_bytes, error: card.status.error });
    }
    render(current);
  }

  // models: ui/state's `models` (the live panel's poll)
  function showModelStates(models, current) {
    for (const model of models) {
      states.set(model.name, model);
      for (const alias of model.aliases) states.set(alias, model); // /v1/models lists it too
    }
    render(current);
    const chosen = states.get(current);
    $("model-name").dataset.state = chosen ? chosen.state : "loaded";
  }

  function modelState(name) {
    const model = states.get(name);
    return model ? model.state : "loaded";
  }

  window.chatModels = { showModelCards, showModelStates, modelState };
})();
