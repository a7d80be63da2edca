# The two quickstart commands: `make serve` and `make test`. Both create .venv on first use.
.PHONY: serve demo test bench install

install:
	@./scripts/bootstrap.sh

serve: install
	.venv/bin/prefixserve serve $(ARGS)

demo: install
	.venv/bin/prefixserve demo $(ARGS)

test: install
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)
