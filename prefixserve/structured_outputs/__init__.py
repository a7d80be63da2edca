"""Grammar-constrained decoding with xgrammar (JSON schema, regex, choice, EBNF, forced tool calls).

``params`` says what a request asks for (light: no xgrammar import), ``manager`` compiles it off
the engine thread with a cache, ``grammar`` tracks one sequence and masks the logits,
``json_grammar`` fixes the JSON format (one line, ``", "`` and ``": "``), ``tool_calls`` builds the
grammar of forced tool calls in the chat template's own syntax and parses what they generate.
Import the submodules directly; this package imports nothing, so ``import prefixserve`` stays
light.
"""
