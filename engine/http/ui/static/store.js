// What the chat page keeps in the browser's local storage: the chats, the current one, the
// settings and the API key. Nothing of it is sent anywhere but to this server's API.
"use strict";

(function () {
  const PREFIX = "engine-chat.";
  // null: the field is left out of the request, and the server's default for the model applies
  // (its own sampling defaults or llama.cpp's, and the server's output bound).
  const DEFAULT_SETTINGS = { system: "", temperature: null, top_p: null, max_tokens: null, extra: "" };

  function read(name, fallback) {
    try {
      const text = localStorage.getItem(PREFIX + name);
      return text === null ? fallback : JSON.parse(text);
    } catch (e) {
      return fallback; // unreadable (another page's format, or storage off): start afresh
    }
  }

  function write(name, value) {
    try {
      localStorage.setItem(PREFIX + name, JSON.stringify(value));
      return true;
    } catch (e) {
      return false; // over the quota: the caller drops old chats and tries again
    }
  }

  // An answer still streaming when the page was closed ended there: its request was aborted.
  function endInterrupted(chats) {
    for (const chat of chats) {
      for (const message of chat.messages) {
        if (message.state === "streaming") message.state = "stopped";
      }
    }
    return chats;
  }

  const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);

  const store = {
    chats: endInterrupted(read("chats", [])),
    currentId: read("current", null),
    settings: { ...DEFAULT_SETTINGS, ...read("settings", {}) },

    apiKey() { return read("key", ""); },
    setApiKey(key) { key ? write("key", key) : localStorage.removeItem(PREFIX + "key"); },

    current() { return this.chats.find((c) => c.id === this.currentId) || null; },

    newChat() {
      const chat = { id: newId(), title: "New chat", created: Date.now(), messages: [] };
      this.chats.unshift(chat);
      this.currentId = chat.id;
      this.save();
      return chat;
    },

    select(id) { this.currentId = id; this.save(); },

    remove(id) {
      this.chats = this.chats.filter((c) => c.id !== id);
      if (this.currentId === id) this.currentId = this.chats.length ? this.chats[0].id : null;
      this.save();
    },

    saveSettings(settings) { this.settings = settings; write("settings", settings); },

    save() {
      // The oldest chats go first when the browser's quota is reached.
      while (!write("chats", this.chats) && this.chats.length > 1) this.chats.pop();
      write("current", this.currentId);
    },
  };

  window.chatStore = store;
})();
