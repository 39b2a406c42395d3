# Two commands do all the set-up on a fresh machine:
#   make run   — install, then run the main job on the embedded stack (no servers to start)
#   make test  — install, then run lint, import contracts and the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: install run test lint unit integration bench compose-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

run: install
	$(BIN)/kiln demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# Whole files per test process, the slowest first (tests/conftest.py; without
# --no-loadscope-reorder xdist would start the files with the most tests first, and a long
# file of one test, started last, would run alone at the end). Four test processes
# whatever the core count: the integration tests spend much of their time waiting on the
# processes they start (stacks, agents, restarts, outages held on purpose), so on two cores
# two test processes leave the CPU idle for long stretches (vmstat during a run shows it);
# Redis' 16 databases allow five (three each, tests/conftest.py). A test process that dies
# ends the run at once, naming its test: under --dist loadfile, xdist's replacement of a
# crashed process can wait forever for work that is never sent.
test: lint
	$(BIN)/pytest -q -p no:cacheprovider --durations=25 -n 4 --dist loadfile --no-loadscope-reorder --max-worker-restart=0

bench: install
	$(BIN)/python bench/submit_to_artifact.py
	$(BIN)/python bench/agent.py
	$(BIN)/python bench/retune.py
	$(BIN)/python bench/custom_ops.py
	$(BIN)/python bench/worker_loss.py
	$(BIN)/python bench/faults.py
	$(BIN)/python bench/front_door.py
	$(BIN)/python bench/sandbox.py
	$(BIN)/python bench/store_verify.py
	$(BIN)/python bench/ui.py
	$(BIN)/python bench/crossbackend.py
	$(BIN)/python bench/stack_cycle.py
	$(BIN)/python bench/spin_gap.py
	$(BIN)/python bench/zoo_tuned.py

compose-check:
	KILN_SECRET_KEY=placeholder POSTGRES_PASSWORD=x MINIO_ROOT_USER=x MINIO_ROOT_PASSWORD=placeholder KILN_AGENT_TOKEN=x KILN_AGENT_SERVE_TOKEN=x KILN_WORKER_TOKEN=x \
	  docker-compose -f docker-compose.yml --profile gpu config --quiet

clean:
	rm -rf .kiln build *.egg-info
