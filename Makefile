# PerfectSched developer entry points.  `make run` and `make test` work from a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEVCFG := etc/dev.yml

.PHONY: run test test-deps test-newest test-debian lint bench deb clean

$(BIN)/perfectschedd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

run: $(BIN)/perfectschedd
	mkdir -p var
	$(BIN)/perfectschedctl -c $(DEVCFG) init
	PYTHONPATH=etc/demo $(BIN)/perfectschedd -c $(DEVCFG)

lint: $(BIN)/perfectschedd
	$(BIN)/ruff check .

test-deps:
	./tests/install-test-deps.sh

test-newest: $(BIN)/perfectschedd
	$(BIN)/pytest -q

test: test-deps lint test-newest test-debian

clean:
	rm -rf $(VENV) .venv-debian var dist build *.egg-info
