# The two commands of the README. Each does its own set-up on a fresh clone: a virtualenv in .venv with the
# package (CPU TensorFlow) and the test/tool extras installed at the exact versions of constraints.txt.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[cpu,test]'
	touch $(STAMP)

# Demo: digits as ImageNet-format TFRecords, ResNet-18 under MirroredStrategy on 4 logical CPU devices,
# ends with the held-out top-1 and writes runs/demo/metrics.png. A second run resumes (and finishes at once):
# `make demo FRESH=1` starts over.
demo: $(STAMP)
	$(BIN)/python tools/make_demo_data.py --output_dir data/demo
	$(if $(FRESH),rm -rf runs/demo)
	$(BIN)/imagenet-tpu-train --flagfile=flags/demo.cfg
	$(BIN)/python tools/plot_metrics.py --model_dir runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) data/demo runs/demo
