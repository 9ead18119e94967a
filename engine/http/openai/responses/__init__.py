"""OpenAI's Responses API (/v1/responses): its request structs, the adapter onto the chat path,
and the store of finished responses that `previous_response_id` continues."""
