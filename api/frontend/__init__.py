"""The shared front half: what chat completions, Responses and Messages all use to turn a request
into engine inputs, admit it, read its deltas, and tell tenants apart."""
