"""OpenAI's Responses API: items, tools, the response store, continuations, its event encoder and
WebSocket mode."""
