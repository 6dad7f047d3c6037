"""The package's shape: importing ``kitty`` does no work, and ``kitty.kernels`` coexists with Hugging Face's
``kernels`` hub package (which transformers imports by that name) from any working directory.

Each check runs in a fresh interpreter. The hub package is faked (a ``kernels`` package with distribution metadata
in a temporary folder on ``PYTHONPATH``), so the checks need no network.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(code: str, cwd: Path, *paths: Path) -> str:
    """``code`` in a fresh interpreter with ``paths`` first on its path, then this process's ``PYTHONPATH`` (the
    same transformers release as this run: the compat sets put theirs there)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, paths), *inherited]))
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return r.stdout


# What transformers imports from the hub package: layer decorators (identity here) and classes (inert stubs).
HUB_STUB = """
HUB = True


def use_kernel_forward_from_hub(*args, **kwargs):
    return lambda obj: obj


use_kernelized_func = use_kernel_forward_from_hub


class _Stub:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return self


def __getattr__(name):
    return type(name, (_Stub,), {})
"""


@pytest.fixture(scope="module")
def hub_kernels(tmp_path_factory) -> Path:
    """A folder holding a stand-in for Hugging Face's ``kernels`` package, at a version transformers accepts."""
    from transformers.utils.import_utils import KERNELS_MIN_VERSION

    site = tmp_path_factory.mktemp("site")
    (site / "kernels").mkdir()
    (site / "kernels" / "__init__.py").write_text(f"__version__ = {KERNELS_MIN_VERSION!r}\n" + HUB_STUB)
    meta = site / f"kernels-{KERNELS_MIN_VERSION}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kernels\nVersion: {KERNELS_MIN_VERSION}\n")
    return site


USE_BOTH = """
    import torch
    import kernels
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils.import_utils import is_kernels_available
    import kitty.kernels
    from kitty import KittyCache
    from kitty.hf.compat import cache_kwargs

    assert kernels.HUB and is_kernels_available(), kernels  # the hub package, as transformers sees it
    assert kitty.kernels.__path__ == [{kernels_dir!r}], kitty.kernels.__path__
    assert callable(kitty.kernels.decode_attention_ref)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    model = LlamaForCausalLM(config).eval()
    cfg = kitty.PRESETS["kitty"].with_(sink_tokens=2, group_size=8, local_window=4)
    out = model.generate(torch.randint(0, 64, (1, 12)), **cache_kwargs(KittyCache(model.config, cfg)), max_new_tokens=12,
                         do_sample=False)
    print("OK", out.shape[1])
"""


@pytest.mark.parametrize("where", ["repository root", "another folder"])
def test_kitty_kernels_and_the_hub_kernels_package_coexist(hub_kernels, tmp_path, where):
    """From the repository root the top-level ``kernels/`` folder (a namespace directory, no ``__init__.py``) does
    not shadow the hub package; from another folder ``kitty`` finds its kernels by its own location."""
    cwd = ROOT if where == "repository root" else tmp_path
    out = run(USE_BOTH.format(kernels_dir=str(ROOT / "kernels")), cwd, hub_kernels, ROOT)
    assert "OK 24" in out


def hub_installed() -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("kernels")
    except PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(hub_installed(), reason="the hub package is installed (transformers >= 5.25 requires it)")
def test_without_the_hub_package_transformers_sees_no_kernels():
    """transformers' probe imports a ``kernels`` it finds without metadata: ours is an empty namespace to it."""
    out = run(
        """
        from transformers.utils.import_utils import is_kernels_available
        import kernels, sys
        assert not is_kernels_available()
        assert getattr(kernels, "__file__", None) is None  # the namespace directory, nothing executed
        assert "triton" not in sys.modules
        print("OK")
    """,
        ROOT,
    )
    assert "OK" in out


@pytest.mark.skipif(not hub_installed(), reason="the hub package is not installed (transformers < 5.25 runs without)")
def test_the_installed_hub_package_wins_over_the_kernels_folder():
    """With the real hub package installed (a dependency of transformers from 5.25), ``import kernels`` from the
    repository root is the hub's, and ``kitty.kernels`` still reads the repository's folder."""
    out = run(
        f"""
        import kernels
        import kitty.kernels
        assert kernels.__file__ and not kernels.__file__.startswith({str(ROOT / "kernels")!r}), kernels.__file__
        assert kitty.kernels.__path__ == [{str(ROOT / "kernels")!r}], kitty.kernels.__path__
        assert callable(kitty.kernels.decode_attention_ref)
        print("OK")
    """,
        ROOT,
    )
    assert "OK" in out


def test_import_kitty_reads_no_profile_and_loads_no_model_code():
    """``import kitty`` only defines things: no profile JSON is read until a layer-adaptive preset is used."""
    out = run(
        """
        import builtins, pathlib, sys
        reads = []
        read_text, open_ = pathlib.Path.read_text, builtins.open
        pathlib.Path.read_text = lambda self, *a, **k: reads.append(str(self)) or read_text(self, *a, **k)
        builtins.open = lambda f, *a, **k: reads.append(str(f)) or open_(f, *a, **k)
        import kitty
        assert not [r for r in reads if r.endswith(".json")], reads
        assert "transformers" not in sys.modules and "kitty.cache" not in sys.modules
        names = list(kitty.PRESETS)
        assert "kitty-fit-adaptive" in names and not [r for r in reads if r.endswith(".json")]
        assert len(kitty.PRESETS["kitty-fit-adaptive"].boost_profile) == 30
        assert [r for r in reads if r.endswith("SmolLM2-135M-Instruct.json")]
        print("OK")
    """,
        ROOT,
    )
    assert "OK" in out


# What kernels/ may import of kitty: the data contract (a kernel reads and writes storage, it never decides which
# backend runs or how a cache behaves).
KERNELS_CONTRACT = {
    "kitty.core.config",
    "kitty.core.quant",
    "kitty.core.ranges",
    "kitty.core.storage",
    "kitty.core.memory",
    "kitty.core.pages",
}


def import_graph() -> dict[str, set[str]]:
    """Module -> the library modules it imports (kitty/*.py, and kernels/*.py as kitty.kernels.*), lazy imports inside
    functions included, and the submodules that kitty/kernels.py loads by name (its ``_EXPORTS`` table, read by
    ``import_module``), which no import statement shows."""
    import ast

    graph: dict[str, set[str]] = {}
    for folder, package in ((ROOT / "kitty", "kitty"), (ROOT / "kernels", "kitty.kernels")):
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            here = name if is_package else name.rsplit(".", 1)[0]  # the package relative imports start from
            deps = graph.setdefault(name, set())
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = ".".join(here.split(".")[: len(here.split(".")) - node.level + 1])
                    if node.module:
                        deps.add(f"{base}.{node.module}")
                        deps.update(f"{base}.{node.module}.{a.name}" for a in node.names)  # submodules
                    else:
                        deps.update(f"{base}.{a.name}" for a in node.names)
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kitty."):
                    deps.add(node.module)
                    deps.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names if a.name.startswith("kitty."))
                elif name == "kitty.kernels" and isinstance(node, ast.Assign):
                    if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
                        deps.update(f"kitty.kernels.{m}" for m in ast.literal_eval(node.value).values())
    assert {"kitty.kernels.reference", "kitty.kernels.pack"} <= graph["kitty.kernels"], "_EXPORTS was not read"
    return {n: {d for d in deps if d in graph and d != n} for n, deps in graph.items()}


def test_kitty_modules_import_each_other_without_a_cycle():
    """The library's modules import one way (docs/ARCHITECTURE.md): no module reaches itself through its imports,
    lazy ones and kitty/kernels.py's ``import_module`` loads included."""
    graph = import_graph()

    def reaches(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(graph[n])
        return seen

    assert len(graph) > 20, sorted(graph)  # both folders were read
    assert [n for n in graph if n in reaches(n)] == []


# What each layer of kitty/ may import of kitty (docs/ARCHITECTURE.md, "Module map"): a module of the package on the
# left imports only modules under the prefixes on the right (its own package included) and kitty.lazy.
LAYERS = {
    "kitty.core": ("kitty.core",),
    "kitty.hf.compat": ("kitty.core.config",),
    "kitty.cache": ("kitty.core", "kitty.kernels", "kitty.hf.compat", "kitty.cache"),
    "kitty.hf": ("kitty.core", "kitty.kernels", "kitty.hf", "kitty.cache"),
}


def test_each_layer_imports_only_the_layers_below():
    graph = import_graph()

    def layer(name: str) -> str | None:
        return max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len, default=None)

    wrong = {
        n: sorted(
            d for d in deps if d != "kitty.lazy" and not any(d == a or d.startswith(a + ".") for a in LAYERS[layer(n)])
        )
        for n, deps in graph.items()
        if layer(n)
    }
    assert {n: d for n, d in wrong.items() if d} == {}
    assert {"kitty.core.quant", "kitty.cache.static", "kitty.hf.generate", "kitty.tools.cli"} <= set(graph)


def test_kernels_import_only_the_data_contract():
    """kernels/*.py import, of kitty, only the data contract and each other: never backend, cache, layer, ..."""
    graph = import_graph()
    kernels = [n for n in graph if n.startswith("kitty.kernels.")]
    assert len(kernels) >= 8, kernels
    outside = {
        n: sorted(d for d in graph[n] if not d.startswith("kitty.kernels") and d not in KERNELS_CONTRACT)
        for n in kernels
    }
    assert {n: d for n, d in outside.items() if d} == {}
