# Two commands do all set-up on a fresh machine:
#   make run    creates .venv, installs tokenrelay, serves the bundled model on 127.0.0.1:1025
#   make test   same venv, finds or starts Kafka, runs every test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
KAFKA_JARS := deploy/kafka/lib/.fetched
HELM_RENDER := .tools/bin/helm-render

.PHONY: install run test kafka helm-render lint gpu-check clean

# uv installs torch's wheels in seconds where pip takes minutes; it lives in the venv.
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[test]'
	# Compile the engine's C++ decode kernel now (cached on disk), not in the first request's path.
	$(BIN)/python -c "from workers.engine.attention import decode_kernel; decode_kernel()"
	touch $@

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

test: install kafka helm-render
	$(BIN)/pytest

# On a machine with an NVIDIA GPU: the engine's exactness tests on CUDA and its GPU bench, one summary.
gpu-check:
	.ci/gpu-check

# Style: ruff's rules as configured in pyproject.toml (uv fetches ruff on first use).
lint: install
	$(BIN)/uv tool run ruff check bus gateway schemas tokenrelay workers tests
	$(BIN)/uv tool run ruff format --check bus gateway schemas tokenrelay workers tests

clean:
	rm -rf $(VENV) deploy/kafka/lib .tools
