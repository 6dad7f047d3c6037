"""KittyCache under transformers' tensor parallelism: 2 CPU ranks (gloo) generate what one process generates.

The test saves tiny random-weight Llama and Qwen3 models (8 query / 4 KV heads, fp32) to a temporary folder,
generates greedily in this process, then launches this file under ``torchrun --nproc-per-node 2``: each rank loads
the models with ``from_pretrained(..., tp_plan="auto")``, holds 2 of the 4 KV heads per layer and generates with
``KittyCache(model.config, ...)``. Tiny Kitty sizes (S=4, G=8, R=8) make pages fill within the prompt, so decode
steps read quantized pages. Rank 0 writes the tokens and memory reports to a JSON file the test compares.

Both presets are compared token for token. Exactness is expected for ``kitty`` too because its quantization is
per KV head (scales, zeros and boosted channels of one head depend on that head's keys alone) and every rank holds
whole heads; the only difference between 1 and 2 ranks is the order of the fp32 sums in the row-parallel
projections (all-reduce), which could in principle flip a 2-bit code that lies on a rounding boundary. The test
therefore also compares every step's logits (within 1e-4), so such a flip would show as a failure, not pass
silently; in these runs tokens were identical for both presets and both families.

The command line and the evaluation are launched the same way (``torchrun ... -m kitty``, ``-m kitty.eval``) on a
random-weight Llama saved with the default model's tokenizer: the sharded CLI prints once (rank 0) the texts and
token placement of one process, with the report's total over ranks; the sharded quick eval writes one set of results
whose perplexities match one process's within bf16 rounding. A model whose KV heads do not divide by ``WORLD_SIZE``
is refused with a message, before its weights load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the worker runs as a script under torchrun
    sys.path.insert(0, str(ROOT))

FAMILIES = ("llama", "qwen3")
PRESETS_USED = ("fp16", "kitty")
PROMPT_LENGTHS = (37, 22)  # a left-padded batch; both rows pass S + G + R = 20, so key and value pages exist
NEW_TOKENS = 12


def save_models(folder: Path, families=FAMILIES, tokenizer=None, num_key_value_heads: int = 4) -> None:
    """Random-weight Llama and/or Qwen3 (4 KV heads, divisible by 2 ranks) saved as ``folder/<family>``.

    ``tokenizer``: saved beside the weights (a folder the CLI can load), the vocabulary sized to it; else 128 ids.
    """
    from fixtures import tiny_model

    sizes = dict(
        num_attention_heads=8,
        num_key_value_heads=num_key_value_heads,
        vocab_size=128 if tokenizer is None else len(tokenizer),
    )
    for family in families:
        tiny_model(family, **sizes).save_pretrained(folder / family)  # seed 0
        if tokenizer is not None:
            tokenizer.save_pretrained(folder / family)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` ``[2, 37]`` from a fixed seed."""
    gen = torch.Generator().manual_seed(3)
    L = max(PROMPT_LENGTHS)
    ids = torch.zeros(len(PROMPT_LENGTHS), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(PROMPT_LENGTHS):
        ids[b, L - n :] = torch.randint(1, 128, (n,), generator=gen)
        mask[b, L - n :] = 1
    return ids, mask


def generate_all(folder: Path, tp: bool) -> dict:
    """Greedy tokens, logits and memory report per (family, preset), in one process or on this TP rank."""
    from transformers import AutoModelForCausalLM

    from kitty import PRESETS, KittyCache
    from kitty.hf.compat import cache_kwargs

    ids, mask = batch()
    out = {}
    for family in FAMILIES:
        kwargs = {"tp_plan": "auto"} if tp else {}
        model = AutoModelForCausalLM.from_pretrained(folder / family, dtype=torch.float32, **kwargs).eval()
        for name in PRESETS_USED:
            cache = KittyCache(model.config, PRESETS[name].with_(sink_tokens=4, group_size=8, local_window=8))
            res = model.generate(
                input_ids=ids,
                attention_mask=mask,
                **cache_kwargs(cache),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
            rep = cache.memory_report()
            out[f"{family}/{name}"] = {
                "tokens": res.sequences[:, ids.shape[1] :].tolist(),
                "scores": torch.stack(res.scores).tolist(),
                "layer_heads": [layer.num_kv_heads for layer in cache.layers],
                "pages": cache.token_counts()["key_pages"],
                "lengths": cache.lengths,
                "report": {
                    "ranks": rep.ranks,
                    "stored": rep.stored_bytes,
                    "total": rep.total_stored_bytes,
                    "fp16": rep.fp16_bytes,
                    "total_fp16": rep.total_fp16_bytes,
                    "summary": rep.summary(),
                },
            }
    return out


def worker(folder: Path) -> None:
    """One rank under torchrun: generate, sum the stored bytes over ranks, rank 0 writes ``tp.json``."""
    import torch.distributed as dist

    out = generate_all(folder, tp=True)
    for item in out.values():  # the bytes really held over all ranks, for the report's ``total`` to be checked
        held = torch.tensor([item["report"]["stored"]], dtype=torch.float64)
        dist.all_reduce(held)
        item["report"]["summed_over_ranks"] = int(held.item())
    if dist.get_rank() == 0:
        (folder / "tp.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def torchrun(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 <args>`` on CPU, one thread per rank, offline."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_two_ranks_generate_what_one_process_generates(tmp_path):
    from kitty import PRESETS, analytic_report

    save_models(tmp_path)
    one = generate_all(tmp_path, tp=False)
    proc = torchrun([__file__, str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = json.loads((tmp_path / "tp.json").read_text())
    for key, ref in one.items():
        got = two[key]
        assert got["tokens"] == ref["tokens"], key
        torch.testing.assert_close(torch.tensor(got["scores"]), torch.tensor(ref["scores"]), rtol=1e-4, atol=1e-4)
        assert ref["layer_heads"] == [4, 4] and got["layer_heads"] == [2, 2]  # each rank sized to its shard
        assert got["lengths"] == ref["lengths"] and got["pages"] == ref["pages"] > 0  # decode read real pages
        rep, rep1 = got["report"], ref["report"]
        cfg = PRESETS[key.split("/")[1]].with_(sink_tokens=4, group_size=8, local_window=8)
        per_rank = analytic_report(cfg, got["lengths"], 16, num_kv_heads=2, num_layers=2, dtype_bytes=4)
        assert rep["ranks"] == 2 and rep["stored"] == per_rank.stored_bytes and rep["fp16"] == per_rank.fp16_bytes
        assert rep["total"] == rep["summed_over_ranks"] == rep1["stored"] and rep["total_fp16"] == rep1["fp16"]
        assert "per rank of 2" in rep["summary"]


def test_kv_heads_that_do_not_divide_by_the_ranks_raise_at_construction():
    from fixtures import tiny_config
    from transformers.distributed import DistributedConfig

    from kitty import KittyCache

    config = tiny_config(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, num_hidden_layers=1)
    config.distributed_config = DistributedConfig(tp_size=2)
    with pytest.raises(ValueError, match="tp_size=2"):
        KittyCache(config, "kitty")
    config.distributed_config = DistributedConfig(tp_size=3)
    assert KittyCache(config, "kitty").num_kv_heads == 1


# ------------------------------------------------------------------------------- the CLI and eval, sharded

CLI_METHODS = "fp16,kitty+sink_tokens=4+group_size=8+local_window=8"  # tiny pages: decode reads key and value pages
CLI_PROMPT = (
    "A transformer caches the keys and values of every token it has read, so that each new token attends to them "
    "without recomputing the past. This cache grows with the context."
)


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory) -> Path:
    """A random-weight Llama (4 KV heads) with the default model's tokenizer: a folder ``--model`` can load."""
    from transformers import AutoTokenizer

    from kitty.hf.models import resolve_default_model

    folder = tmp_path_factory.mktemp("cli")
    save_models(folder, ("llama",), AutoTokenizer.from_pretrained(resolve_default_model()))
    return folder / "llama"


def test_cli_sharded_prints_once_the_text_of_one_process(cli_model, tmp_path):
    from kitty.tools.cli import main

    args = [CLI_PROMPT, "--model", str(cli_model), "--compare", "--methods", CLI_METHODS, "--max-new-tokens", "12"]
    args += ["--dtype", "float32"]  # bf16 would round each rank's partial sums before the all-reduce
    assert main([*args, "--json", str(tmp_path / "one.json")]) == 0
    proc = torchrun(["-m", "kitty", *args, "--json", str(tmp_path / "two.json")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    assert [r["method"] for r in two] == CLI_METHODS.split(",")
    for ref, got in zip(one, two):
        assert got["text"] == ref["text"] and got["new_tokens"] == ref["new_tokens"] == 12, got["method"]
        assert got["counts"] == ref["counts"]
        assert got["report"]["ranks"] == 2 and ref["report"]["ranks"] == 1
        assert got["report"]["total_stored_bytes"] == ref["report"]["stored_bytes"] == 2 * got["report"]["stored_bytes"]
    assert two[1]["counts"]["key_pages"] > 0 and two[1]["counts"]["value_pages"] > 0
    assert proc.stdout.count("| method |") == 1 and proc.stdout.count("[fp16]") == 1  # rank 0 alone prints
    assert "per rank of 2, total" in proc.stdout


def test_cli_refuses_heads_that_do_not_divide_before_loading(tmp_path, monkeypatch, capsys):
    from fixtures import tiny_config

    import kitty.hf.models
    from kitty.tools.cli import main

    tiny_config(hidden_size=48, num_attention_heads=3, num_key_value_heads=3).save_pretrained(tmp_path)

    def no_load(*args, **kwargs):
        raise AssertionError("the weights must not load for a bad launch")

    monkeypatch.setattr(kitty.hf.models, "load_model", no_load)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc-per-node 2 sets it, without starting ranks
    monkeypatch.setenv("RANK", "0")
    assert main(["hello", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot shard the model over 2 ranks") and "3 KV heads" in err
    assert "Traceback" not in err
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["hello", "--model", str(tmp_path), "--tp"]) == 2
    assert "--tp needs a launch by torchrun" in capsys.readouterr().err
    assert main(["hello", "--model", str(tmp_path), "--json", str(tmp_path / "no" / "such.json")]) == 2
    assert "--json" in capsys.readouterr().err


def test_eval_sharded_smoke_matches_one_process(cli_model, tmp_path):
    import csv

    from kitty.tools.eval import main

    args = ["--model", str(cli_model), "--quick", "--methods", "fp16,kitty", "--skip", "passkey,pack"]
    main([*args, "--out", str(tmp_path / "one")])
    proc = torchrun(["-m", "kitty.eval", *args, "--out", str(tmp_path / "two")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("# Kitty evaluation (quick)") == 1 and "2 tensor-parallel ranks" in proc.stdout

    def rows(folder: str, name: str) -> list[dict]:
        with open(tmp_path / folder / name) as f:
            return list(csv.DictReader(f))

    one, two = rows("one", "eval_ppl_quick.csv"), rows("two", "eval_ppl_quick.csv")
    assert [(r["method"], r["text"]) for r in two] == [(r["method"], r["text"]) for r in one] and len(two) == 6
    # bf16 weights: each rank's partial sums are rounded before the all-reduce (measured: NLL within 1e-5 relative)
    torch.testing.assert_close(
        torch.tensor([float(r["nll"]) for r in two]), torch.tensor([float(r["nll"]) for r in one]), rtol=1e-4, atol=0
    )
    assert rows("two", "eval_agreement_quick.csv")[0]["method"] == "kitty"


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
