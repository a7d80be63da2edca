"""How users start prefixserve: the command line, engine arguments and the offline ``LLM`` API."""
