# The two commands of the README. Each does its own set-up on a fresh clone: a virtualenv in .venv with the
# package (CPU TensorFlow) and the test/tool extras installed at the exact versions of constraints.txt.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-faults rehearse peer benchmark-trainer clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[cpu,test]'
	touch $(STAMP)

# Demo: digits as ImageNet-format TFRecords, ResNet-18 under MirroredStrategy on 4 logical CPU devices,
# ends with the held-out top-1 and writes runs/demo/metrics.png. A second run resumes (and finishes at once):
# `make demo FRESH=1` starts over.
demo: $(STAMP)
	$(BIN)/python tools/data/make_demo_data.py --output_dir data/demo
	$(if $(FRESH),rm -rf runs/demo)
	$(BIN)/imagenet-tpu-train --flagfile=flags/demo.cfg
	$(BIN)/python tools/plots/plot_metrics.py --model_dir runs/demo

# Two pytest processes (pytest-xdist), each test file in one of them: most of a test's time is tracing, which
# runs on one core. Files are handed out in the order tests/conftest.py sets (files with slow tests first);
# --no-loadscope-reorder keeps pytest-xdist from reordering them by their number of tests. TEST_JOBS=1 runs the
# suite in one process.
TEST_JOBS ?= 2
PYTEST := $(BIN)/python -m pytest -q $(if $(filter 1,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder)

test: $(STAMP)
	$(PYTEST) tests

# The fast tier: every module, without the tests marked slow (real training processes, 8-replica traces).
test-fast: $(STAMP)
	$(PYTEST) -m 'not slow' tests

# The fault tier: careless, scripted and hostile use of a run (tests marked faults; part of `make test` too).
test-faults: $(STAMP)
	$(PYTEST) -m faults tests

# Every recipe that comes with the package rehearsed on simulated hosts: its settings, shrunk sizes, preempted,
# resumed, evaluated, exported and planned (imagenet_tpu/rehearse.py). The second step of .ci/run.
rehearse: $(STAMP)
	$(BIN)/imagenet-tpu-rehearse --recipe=all

# tf-models-official, our peer in benchmarks, in an environment of its own (it pins other versions: BUILD.md).
PEER := .venv-peer
$(PEER)/.installed:
	$(PYTHON) -m venv $(PEER)
	$(PEER)/bin/python -m pip install --quiet --upgrade pip
	$(PEER)/bin/python -m pip install --quiet 'tf-models-official==2.20.0'
	$(PEER)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

peer: $(PEER)/.installed

# Our command line against tf-models-official's trainer on ImageNet-like records (BUILD.md): two processes of each
# taking turns, 10 timed steps a turn, 4 rounds (docs/benchmarks.md T25: one process per candidate measures the
# process as much as the trainer).
benchmark-trainer: $(STAMP) $(PEER)/.installed
	ls data/benchmark/validation-* >/dev/null 2>&1 || $(BIN)/python tools/data/make_benchmark_data.py --output_dir data/benchmark --num_images 2000
	$(BIN)/python tools/benchmarks/benchmark_trainer.py --data_dir data/benchmark --peer_python $(PEER)/bin/python

clean:
	rm -rf $(VENV) $(PEER) data/demo runs/demo
