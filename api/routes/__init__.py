"""The HTTP routes, one router per area, each over the servings ``api.server.build_app`` made:
``service`` (liveness, version, models), ``generate`` (the four protocols' POSTs),
``responses`` (stored responses and the WebSocket), ``kv`` (releasing retained KV) and
``tokenization``. A router only binds paths to servings: no state, no logic of its own."""
