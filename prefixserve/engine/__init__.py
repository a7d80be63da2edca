"""The step loop: ``LLMEngine`` (schedule -> run -> update), the scheduler (the one owner of
sequence state) and its request lifecycle, the request preprocessor with chat-template rendering,
and what turns samples into finished requests (stop checker, output processor)."""
