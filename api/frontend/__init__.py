"""The shared front half: what chat completions, Responses and Messages all use to turn a request
into engine inputs, admit it, drive its stream, and tell tenants apart."""
