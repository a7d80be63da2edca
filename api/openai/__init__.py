"""OpenAI's wire formats: chat completions, text completions and the Responses API."""
