# Set-up is part of every target: a fresh Debian machine with Python 3.11 needs nothing else.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: setup demo test lab-doc bench clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# constraints.txt pins torch (an unpinned torch pulls a multi-GB CUDA build): one place.
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $@

# The main job on the embedded local cluster: 2 active nodes x 2 ranks, 2 hot spares,
# one worker SIGKILLed at step 40 and a GPU "fallen off the bus" (Xid 79) at step 150.
# Then `resild report` splits its wall time into productive steps, start-up and each recovery's
# phases, and draws runs/demo-report.png (the picture in the README: docs/demo-report.png).
demo: setup
	mkdir -p runs
	rm -f runs/demo-events.jsonl  # --events appends: one job per file
	$(BIN)/resil-run --local --nodes 4 --spares 2 --nproc-per-node 2 \
	  --events runs/demo-events.jsonl \
	  --inject kill:node1@40 --inject xid79:node0@150 \
	  -- $(BIN)/python examples/train.py --steps 300 --save runs/demo-final.pt
	$(BIN)/resild report runs/demo-events.jsonl --plot runs/demo-report.png

test: setup
	$(BIN)/ruff format --check resild launcher plugins tests bench examples
	$(BIN)/ruff check resild launcher plugins tests bench examples
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/pytest -q

# The Slurm lab's documentation run: tests of Slurm's own behaviour (what resild works
# around, docs/slurm-batch-host.md) whose timing is Slurm's; not part of the gate.
lab-doc: setup
	$(BIN)/pytest -q -m slurm_doc tests/slurm

bench: setup
	$(BIN)/python bench/recovery.py

clean:
	rm -rf $(VENV) runs build
