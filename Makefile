# Two commands do all set-up on a fresh machine:
#   make run    creates .venv, installs tokenrelay, serves the bundled model on 127.0.0.1:1025
#   make test   same venv, finds or starts Kafka, runs every test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
KAFKA_JARS := deploy/kafka/lib/.fetched
HELM_RENDER := .tools/bin/helm-render
UV_VERSION := 0.13.9
UV := .tools/uv/bin/uv
RUFF_VERSION := 0.17.6

.PHONY: install lock run test kafka helm-render lint gpu-check clean

# uv installs torch's wheels in seconds where pip takes minutes. It lives in .tools/uv at a pinned
# version, beside the venv rather than in it: `uv sync` makes the venv exactly what uv.lock holds.
$(UV):
	$(PYTHON) -m venv .tools/uv
	.tools/uv/bin/pip install --quiet uv==$(UV_VERSION)

# Exactly the versions of uv.lock (--locked: it stops if pyproject.toml has changed and the lock has not;
# `make lock` moves the lock on purpose). The project itself is installed editable. --compile-bytecode
# writes every dependency's .pyc now (about 20 s on 2 cores): where PYTHONDONTWRITEBYTECODE is set, as on
# these machines and in CI, Python would otherwise compile torch's and transformers' sources again in every
# process it starts, some 7 s of each worker's start.
$(BIN)/.installed: pyproject.toml uv.lock | $(UV)
	UV_PYTHON_DOWNLOADS=never $(UV) sync --locked --extra test --python $(PYTHON) --quiet --compile-bytecode
	@echo "installed from uv.lock:"; $(UV) tree --frozen --depth 1 | tail -n +2
	@$(UV) pip list --python $(BIN)/python --format freeze | grep -E '^(triton|numpy|tokenizers|safetensors)=='
	# Compile the engine's C++ decode kernel now (cached on disk), not in the first request's path.
	$(BIN)/python -c "from workers.engine.attention import decode_kernel; decode_kernel()"
	touch $@

# Every dependency to its newest version that pyproject.toml allows, on purpose (then commit uv.lock).
lock: | $(UV)
	$(UV) lock --upgrade

install: $(BIN)/.installed

run: install
	$(BIN)/tokenrelay serve

$(KAFKA_JARS): deploy/kafka/pom.xml
	mvn --quiet --batch-mode -f deploy/kafka/pom.xml package
	touch $@

kafka: $(KAFKA_JARS)

# The chart's tests render it with Helm's own engine: a small program of ours on Helm's packages
# (deploy/helm/render/) builds in about a minute on 2 cores, where `go install .../helm` takes two or
# more and 110 MB. Built once; rebuilt only when its source changes.
$(HELM_RENDER): deploy/helm/render/main.go deploy/helm/render/go.mod deploy/helm/render/go.sum
	cd deploy/helm/render && go build -trimpath -buildvcs=false -ldflags='-s -w' -o $(CURDIR)/$@ .

helm-render: $(HELM_RENDER)

# Two test processes (pytest-xdist): a test mostly waits on the processes it starts and on Kafka, so two
# of them share two cores well. --dist loadfile keeps a module's tests on one worker, with its servers.
# Before them, lint-imports checks pyproject.toml's import contracts (the layers, no circle): a second.
TEST_WORKERS ?= 2

test: install kafka helm-render
	$(BIN)/lint-imports --no-logo
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile

# On a machine with an NVIDIA GPU: the engine's exactness tests on CUDA and its GPU bench, one summary.
gpu-check:
	.ci/gpu-check

# Style: ruff's rules as configured in pyproject.toml (uv fetches ruff, at a pinned version, on first use).
lint: | $(UV)
	$(UV) tool run ruff@$(RUFF_VERSION) check bus gateway schemas telemetry tokenrelay workers tests
	$(UV) tool run ruff@$(RUFF_VERSION) format --check bus gateway schemas telemetry tokenrelay workers tests

clean:
	rm -rf $(VENV) deploy/kafka/lib .tools
