"""Reading a model's reply: tool-call syntaxes, reasoning blocks, and the one reply parser that
turns text into typed parts for every protocol."""
