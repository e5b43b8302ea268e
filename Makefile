# muoneq — every command creates .venv and installs what is missing on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The registry's default (CUDA-enabled) torch build: the CPU-only wheel cannot load
# torchvision's operators. Override, e.g. TORCH_SPEC="torch torchvision" on a GPU cluster.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install test test-fast lint demo data-fineweb data-c4 train-llama-tiny figure-ns-geometry bench
.PHONY: bench-trial
.PHONY: ablation-cifar10 ablation-gpt2 heatmap-gpt2 ksweep-gpt2 lrsweep-llama130m
.PHONY: lrsweep-llama350m table-llama report tensorboard miniatures
.PHONY: train-cifar10

help: ## list every target
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-22s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[suite,dev,postgres,bench]'
	touch $(STAMP)

install: $(STAMP) ## create .venv and install the package with the suite, dev, postgres and bench extras

# Test processes (pytest-xdist): CI's 2 cores; TEST_WORKERS=auto takes every core, 0 runs in this one
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test: $(STAMP) ## run the whole test suite (CPU; GPU-only tests skip without a GPU; TEST_WORKERS=2)
	$(PYTEST) tests

test-fast: $(STAMP) ## the suite without tests marked slow or distributed
	$(PYTEST) -m "not slow and not distributed" tests

lint: $(STAMP) ## ruff
	$(VENV)/bin/ruff check .

demo: $(STAMP) ## the main job: a miniature of the paper's ablation, offline on CPU (ARGS="--runs-dir DIR")
	$(PY) -m muoneq demo $(ARGS)

# Token shards (`muoneq data`): TOKENS= training-token budget, OUT= folder, ARGS= more flags
# (e.g. ARGS="--workers 32 --hf-config sample-10BT"). Re-running resumes; see docs/language.md "Data".
data-fineweb: $(STAMP) ## tokenize FineWeb (sample-100BT, GPT-2 BPE) to shards: TOKENS=10.5B OUT=data/fineweb
	$(PY) -m muoneq data --source fineweb --tokens $(or $(TOKENS),10.5B) --out $(or $(OUT),data/fineweb) $(ARGS)

data-c4: $(STAMP) ## tokenize C4 en (T5's tokenizer, C4's validation split) to shards: TOKENS=21B OUT=data/c4
	$(PY) -m muoneq data --source c4 --tokenizer hf:google-t5/t5-base --tokens $(or $(TOKENS),21B) --out $(or $(OUT),data/c4) $(ARGS)

train-llama-tiny: $(STAMP) ## CPU run of the language pipeline: shards of TEXT=file.txt, then a tiny LLaMA (TOKENIZER=byte: offline)
	@test -n "$(TEXT)" || { echo "muoneq: no text given; pass TEXT=path/to/tinyshakespeare.txt (any plain-text file)" >&2; exit 2; }
	$(PY) -m muoneq data --source $(TEXT) --out $(or $(OUT),data/shakespeare) --val-tokens 32768 --shard-tokens 1M $(if $(TOKENIZER),--tokenizer $(TOKENIZER))
	$(PY) -m muoneq train experiment=llama_tiny_shakespeare task.data.dir=$(or $(OUT),data/shakespeare) $(if $(TOKENIZER),task.data.tokenizer=$(TOKENIZER)) $(ARGS)

figure-ns-geometry: $(STAMP) ## Figure 1 study: NS error, κ, bias of none/R/C/RC -> runs/ns_geometry[_quick] (QUICK=1: minutes on a laptop's CPU)
	$(PY) -m muoneq spectra $(if $(QUICK),--quick) $(ARGS)

bench: $(STAMP) ## time one optimizer step vs torch.optim.Muon and the public Muons -> runs/bench/step_<device>.json (QUICK=1: smoke run; ARGS="--sets gpt2_small")
	$(PY) -m muoneq bench $(if $(QUICK),--quick) $(ARGS)

bench-trial: $(STAMP) ## what a trial pays besides its steps (a demo trial, a six-trial study beside `import torch`), the loop overhead -> benchmarks/results/trial_cpu.{json,md} (QUICK=1: smoke run; OUT=)
	$(PY) -m muoneq bench-trial $(if $(QUICK),--quick) $(if $(OUT),--out $(OUT)) $(ARGS)

# The GPU check (docs/performance.md "GPU check"): on a lent GPU machine without a registry, carry the wheels
# of `make gpu-wheels` (.whl/) and run `bash benchmarks/gpu_machine.sh check` there.
.PHONY: gpu-check gpu-wheels
gpu-check: $(STAMP) ## gpu tests, bench, GPT2/LLaMA2-130M/ResNet (step breakdown)/LLaMA-FSDP2 runs -> benchmarks/results/<device>.json (DEVICE=cpu QUICK=1: smoke run; OUT=)
	$(PY) -m muoneq gpu-check $(if $(DEVICE),--device $(DEVICE)) $(if $(QUICK),--quick) $(if $(OUT),--out $(OUT)) $(ARGS)

gpu-wheels: $(STAMP) ## download the py3.12 wheels a bare GPU machine lacks (omegaconf, optuna, ...) -> .whl/
	PYTHON=$(PY) bash benchmarks/gpu_machine.sh wheels

# Paper studies (`muoneq sweep … --report`: the sweep, then its report): WORKERS= trials at once
# on this machine (default 1; with ARGS="--set launch.devices_per_trial=1" one GPU each),
# STORAGE= a shared study (postgresql://user@host:port/db) for workers on many machines, ARGS=
# more sweep flags (e.g. ARGS="--set seeds=[0] --override trainer.max_epochs=10"; ARGS=--dry-run
# checks every run's config and lists the runs, ARGS=--status counts them: no report then).
# MINI=1: the study in miniature, <study>-mini, in minutes on a laptop's CPU (its sweep file's
# mini: section, 2 trials at once unless WORKERS=; docs/reproduce.md). Re-running the same
# target continues an interrupted study; nothing finished is run twice. Output:
# runs/<study>/report/. GPU-hours assume ~40% MFU on H100-class GPUs (see docs/sweeps.md).
sweep_and_report = $(PY) -m muoneq sweep sweeps/$(1).yaml --report $(if $(MINI),--mini) \
	--workers $(or $(WORKERS),$(if $(MINI),2,1)) $(if $(STORAGE),--storage $(STORAGE)) $(ARGS)

ablation-cifar10: $(STAMP) ## Table 2: ResNet-18/CIFAR-10, 99 runs x 100 epochs (~40 GPU-h; MINI=1: minutes on a CPU)
	$(call sweep_and_report,ablation-cifar10)

ablation-gpt2: $(STAMP) ## Table 3: GPT2-small/FineWeb 10.5B tok, 96 runs (~850 H100-h; MINI=1: minutes on a CPU)
	$(call sweep_and_report,ablation-gpt2)

heatmap-gpt2: $(STAMP) ## Figures 4c,d and 8: lr x momentum at K=4,5, GPT2-small 2.6B tok, 64 runs (~140 H100-h; MINI=1: minutes on a CPU)
	$(call sweep_and_report,heatmap-gpt2)

ksweep-gpt2: $(STAMP) ## Figure 4a,b: ppl and step time vs K, 12 runs x 10.5B tok (~105 H100-h; MINI=1: minutes on a CPU)
	$(call sweep_and_report,ksweep-gpt2)

lrsweep-llama130m: $(STAMP) ## Figure 5a: LLaMA2-130M/C4 pilot, 42 runs x 2.6B tok (~90 H100-h; MINI=1: minutes on a CPU)
	$(call sweep_and_report,lrsweep-llama130m)

lrsweep-llama350m: $(STAMP) ## Figure 5b: LLaMA2-350M/C4 pilot, 36 runs x 7.5B tok (~620 H100-h; MINI=1: minutes on a CPU)
	$(call sweep_and_report,lrsweep-llama350m)

table-llama: $(STAMP) ## Table 1: LLaMA2 130M/350M/1B on C4, 24 runs (~2,100 H100-h; MINI=1: minutes on a CPU)
	$(call sweep_and_report,table-llama)

miniatures: $(STAMP) ## every study's miniature (MINI=1), the demo, figure-ns-geometry QUICK=1, timed -> benchmarks/results/miniatures.{json,md} (NAMES="demo ...")
	$(PY) benchmarks/miniatures.py $(NAMES) $(ARGS)

RUNS ?= runs
report: $(STAMP) ## tables and figures of STUDY=runs/<name> (or a sweep file); default: every study in RUNS=runs/ (those without a finished run skipped)
	@if [ -n "$(STUDY)" ]; then \
		$(PY) -m muoneq report $(STUDY) $(if $(STORAGE),--storage $(STORAGE)); \
	else \
		found=0; for d in $(RUNS)/*/; do \
			if [ -f "$$d/optuna.journal" ]; then found=1; $(PY) -m muoneq report "$$d" --skip-empty || exit 1; fi; \
		done; \
		[ $$found = 1 ] || { echo "muoneq: no study under $(RUNS)/; run a sweep target first, or pass STUDY=runs/<name>" >&2; exit 2; }; \
	fi

# A study is read through its view of short run names, <study>/tensorboard/ (docs/sweeps.md): its
# folder would show every run twice. Without STUDY, a temporary folder of links names each study
# (its view's runs and report) and each other run folder of RUNS by its folder's name; the
# studies' HParams configs are left out, so that TensorBoard's HParams view holds every study's
# runs with a study column (one study's view: STUDY=).
tensorboard_dir = $(if $(and $(wildcard $(1)/optuna.journal),$(wildcard $(1)/tensorboard/.)),$(1)/tensorboard,$(1))
tensorboard: $(STAMP) ## TensorBoard on STUDY=runs/<name> (its runs by short names; default: every study and run in RUNS=runs/) at http://localhost:6006 (ARGS="--port 6007")
ifneq ($(STUDY),)
	$(VENV)/bin/tensorboard --logdir $(call tensorboard_dir,$(STUDY)) $(ARGS)
else
	@[ -n "$(wildcard $(RUNS)/*/.)" ] || { echo "muoneq: nothing under $(RUNS)/ to show; run a study first (make demo), or pass STUDY=runs/<name>" >&2; exit 2; }
	@links=$$(mktemp -d) && trap 'rm -r "$$links"' EXIT && \
	for d in $(foreach d,$(wildcard $(RUNS)/*/.),$(call tensorboard_dir,$(d:/.=))); do \
		name=$${d#$(RUNS)/}; name=$${name%%/*}; \
		if [ "$$d" = "$(RUNS)/$$name" ]; then ln -s "$$(realpath "$$d")" "$$links/$$name"; \
		else mkdir "$$links/$$name" && for e in "$$d"/*; do \
			[ "$${e##*/}" = hparams ] || [ ! -e "$$e" ] || ln -s "$$(realpath "$$e")" "$$links/$$name/$${e##*/}"; \
		done; fi; \
	done && \
	$(VENV)/bin/tensorboard --logdir "$$links" $(ARGS)
endif

# One run of the paper's CIFAR-10 recipe (conf/experiment/cifar10_resnet18.yaml), e.g.
#   make train-cifar10 OPT=muoneq_nes SEED=1 ARGS="optimizer.mode=RC trainer.devices=4"
train-cifar10: $(STAMP) ## one ResNet-18/CIFAR-10 run, paper recipe: OPT=muoneq_nes SEED=0 ARGS="key=value ..."
	$(PY) -m muoneq train experiment=cifar10_resnet18 optimizer=$(or $(OPT),muoneq_nes) seed=$(or $(SEED),0) $(ARGS)
