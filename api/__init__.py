"""prefixserve.api: the OpenAI-compatible HTTP server (``prefixserve serve``).

``server.create_app`` builds the FastAPI app over an ``async_engine.AsyncEngine``, which runs the
``LLMEngine`` in its own thread. See ``server`` for the routes and error conventions.
"""
