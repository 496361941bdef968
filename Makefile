# The two commands of the README:
#   make train   set up .venv and train the default model (character GPT on Tiny Shakespeare, CPU)
#   make test    set up .venv, start the services the tests use (a local SLURM, headless Chromium;
#                installed if missing, which needs root) and run the whole test suite (what CI runs)
#   make unit    the unit tests only (not slow, not integration), on 2 workers, no services: < 1 min
#   make lint    ruff: lint rules and formatting (make test runs it first)
#   make mutation  mutation testing (mutmut) of the core modules against the fast tests; hours, not in CI
#                (docs/testing.md); one module: make mutation MUTANTS="gptlab.optim*"
# Extra arguments: make train ARGS="model=gpt_nano train.max_steps=200"   make test PYTEST_ARGS="-x"

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
ARGS ?=
PYTEST_ARGS ?=
MUTANTS ?=
# pytest-xdist workers for make test: more than the cores, since many tests wait on subprocesses
# and servers (docs/testing.md: the measured times). The services tests (SLURM, the team server)
# run in one process beside them, which the others yield the CPU to (nice): their jobs' deadlines
# assume a machine not saturated, and they mostly wait. Its commands multiply on one thread, as the
# xdist workers' do (tests/conftest.py): on a shared machine a second thread mostly spins. SLURM and
# the team server are theirs alone, so the others start at once, without waiting for them to be up.
WORKERS ?= 4
NICE ?= 10
# Python writes its bytecode in the recipes even where the environment says not to: pytest then keeps
# the test files it rewrote for their assertions (else every xdist worker rewrites them all again,
# seconds each), and every process the tests start reads compiled modules.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup train test unit lint bytecode mutation clean

setup: $(VENV)/.installed

# torch first, so that pip never picks a multi-GB CUDA build on a machine without a GPU:
# a wheel already on this machine (pip's find-links) wins, then CUDA where nvidia-smi works,
# else PyTorch's CPU-only index.
# A venv cut short (python but no pip) is made again rather than used.
# Then uv resolves and downloads the rest in parallel (pip takes minutes), holding torch to the one
# installed (torch.txt), while torch's bytecode is written on every core beside it; plain pip where
# uv cannot be had. Then the bytecode of the rest: a command (and each of the thousands the tests
# start) then never compiles a library's source, even where PYTHONDONTWRITEBYTECODE keeps Python
# from caching what it compiles. Of LAZY_BYTECODE, large packages of which gptlab imports a small
# part (sympy under torch's dynamo, pandas under MLflow, transformers' GPT-2), only that part:
# importing it once writes it.
LAZY_BYTECODE ?= transformers|sympy|pandas|scipy|sklearn|databricks|networkx|pip|nltk|fontTools|pygments|libcst
WARM_IMPORTS ?= import gptlab.training.build, mlflow, torch._dynamo, matplotlib.pyplot, pygments.lexers; \
	from transformers import GPT2LMHeadModel
SITE = $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python -a -x $(BIN)/pip || $(PYTHON) -m venv --clear $(VENV)
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "torch already installed"; \
	elif $(BIN)/pip install --no-index --no-deps --no-compile "torch==$(TORCH_VERSION)" >/dev/null 2>&1; then \
		echo "torch $(TORCH_VERSION) installed from a local wheel"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/pip install --no-compile "torch==$(TORCH_VERSION)"; \
	else \
		$(BIN)/pip install --no-compile "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu \
			--extra-index-url https://pypi.org/simple; \
	fi
	$(BIN)/python -c 'from importlib.metadata import version as v; print("torch==" + v("torch").split("+")[0])' \
		> $(VENV)/torch.txt
	$(BIN)/python -m compileall -qq -j0 "$(SITE)/torch" & c=$$!; \
	{ $(BIN)/pip install -q uv && $(BIN)/python -m uv pip install -q --python $(BIN)/python \
		-c $(VENV)/torch.txt -e ".[dev,eval]" || $(BIN)/pip install -q --no-compile -e ".[dev,eval]"; }; \
	s=$$?; wait $$c; exit $$s
	$(BIN)/python -m compileall -qq -j0 -x '/site-packages/($(LAZY_BYTECODE))/' "$(SITE)" & c=$$!; \
	$(BIN)/python -c "$(WARM_IMPORTS)"; s=$$?; wait $$c; exit $$s
	touch $@

train: setup
	$(BIN)/python -m gptlab.train $(ARGS)

# Tiny Shakespeare is looked for first: without it the suite stops here with one line
test: setup lint bytecode
	@$(BIN)/python tests/conftest.py >/dev/null
	GPTLAB_CI_SERVICES=chromium bash .ci/with_services.sh sh -c 'log=$$(mktemp); \
		GPTLAB_CI_SERVICES="mlflow_server slurm" OMP_NUM_THREADS=1 bash .ci/with_services.sh \
		$(BIN)/python -m pytest -p no:cacheprovider -m services --durations=10 $(PYTEST_ARGS) >$$log 2>&1 & s=$$!; \
		nice -n $(NICE) $(BIN)/python -m pytest -n $(WORKERS) --dist loadgroup -m "not services" --durations=25 \
		$(PYTEST_ARGS); a=$$?; wait $$s; b=$$?; echo "== the services tests, run beside the others:"; \
		cat $$log; rm -f $$log; [ $$a = 0 ] && { [ $$b = 0 ] || [ $$b = 5 ]; }'

# gptlab's own bytecode too, for the processes the tests start (PYTHONDONTWRITEBYTECODE may be set)
bytecode: setup
	@$(BIN)/python -m compileall -q gptlab hydra_plugins tests >/dev/null

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

unit: setup bytecode
	$(BIN)/python -m pytest -m "not slow and not integration" -n 2 --dist loadgroup $(PYTEST_ARGS)

# mutmut copies gptlab/, tests/ and conf/ into mutants/ and runs pytest there ([tool.mutmut] in
# pyproject.toml), where tests/helpers.py cannot see ../shared: Tiny Shakespeare is found here first.
# Results are kept in mutants/ between runs (only changed functions run again); rm -rf mutants to start over.
mutation: setup
	GPTLAB_SHAKESPEARE="$$($(BIN)/python -c 'import sys; sys.path.insert(0, "tests"); \
		from helpers import find_shakespeare; print(find_shakespeare())')" \
		nice -n 19 $(BIN)/mutmut run $(foreach m,$(MUTANTS),'$(m)')
	$(BIN)/mutmut results

clean:
	rm -rf $(VENV) .pytest_cache mutants
