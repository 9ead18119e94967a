"""One request policy for every front end (HTTP, `LLM`, `AsyncLLM`): the prompt forms a request
may take, the defaults it gets (the model's generation config, the chat template) and every
limit it must keep, applied in one place before the request reaches any actor. Actors keep only
the checks that need what they alone hold (the tokenizer's vocabulary, the scheduler's KV)."""
