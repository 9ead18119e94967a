// One streamed chat completion: POST v1/chat/completions with stream=true, read its
// server-sent events as they come, and hand each delta to the caller. Aborting the signal
// closes the connection, and the server aborts the request when its client leaves.
"use strict";

(function () {
  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  const authHeaders = (key) => (key ? { Authorization: "Bearer " + key } : {});

  async function errorOf(response) {
    let message = `HTTP ${response.status}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message += ": " + body.error.message;
    } catch (e) { /* not JSON: the status alone says it */ }
    return new ApiError(response.status, message);
  }

  async function getJson(path, key) {
    const response = await fetch(path, { headers: authHeaders(key), cache: "no-store" });
    if (!response.ok) throw await errorOf(response);
    return response.json();
  }

  // Each event's data line as parsed JSON; "[DONE]" ends the stream.
  function* events(buffer) {
    for (const block of buffer) {
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }

  async function streamChat(body, key, signal, onChunk) {
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders(key) },
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
      signal,
    });
    if (!response.ok) throw await errorOf(response);
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let pending = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      pending += decoder.decode(value, { stream: true });
      const blocks = pending.split("\n\n");
      pending = blocks.pop();
      for (const event of events(blocks)) {
        if (event.error) throw new ApiError(event.error.code || 500, event.error.message);
        onChunk(event);
      }
    }
  }

  window.chatApi = { ApiError, getJson, streamChat };
})();
