"""KittyCache on a CUDA GPU: the fused Triton kernel against the torch path inside `generate` (skipped without CUDA).

Run on the GPU machine with ``python -m pytest -q tests/test_cuda.py``. Models are tiny, seeded, random-weight Llama
and Qwen3 built from configs (no downloads), in fp16, with prompts long enough to cross S, S+G and S+G+R.

Tolerance for quantized presets (documented): at the first decode step both paths read the same 2-bit pages; the
kernel only accumulates in another order (fp32) and rounds probabilities to the model dtype for its value product,
so those logits may differ by at most 2% of the logits' largest magnitude. Later steps store keys/values computed
from slightly different activations, and a 2-bit code that flips at a rounding boundary moves a value by a whole
step, so differences grow along the sequence (measured on an H200: up to ~10% of the logit scale after 270 steps
on a random Llama with large keys, ~1% on Qwen3 with its k-norm): there we require >= 97% argmax agreement.
"""

import pytest
import torch

from kitty import KittyCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LOGIT_RTOL = 0.02


def tiny_model(kind: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, initializer_range=0.1)
    config = LlamaConfig(**common) if kind == "llama" else Qwen3Config(**common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float16).cuda().eval()


def generate(model, cache, prompt, n):
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache, max_new_tokens=n,
                         min_new_tokens=n, do_sample=False)
    return out[:, prompt.shape[1]:]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fp16_preset_same_tokens_triton_and_torch(kind):
    model = tiny_model(kind)
    prompt = torch.randint(0, 512, (2, 150), generator=torch.Generator().manual_seed(1)).cuda()
    torch_tokens = generate(model, KittyCache(model.config, "fp16", backend="torch"), prompt, 160)
    triton_tokens = generate(model, KittyCache(model.config, "fp16", backend="triton"), prompt, 160)
    same = (torch_tokens == triton_tokens).float().mean().item()
    print(f"{kind} fp16: token agreement triton vs torch {same:.4f} over {torch_tokens.numel()} tokens")
    assert torch.equal(torch_tokens, triton_tokens)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("preset", ["kitty", "kitty-pro", "kivi-k2v2"])
def test_quantized_logits_within_tolerance(kind, preset):
    model = tiny_model(kind)
    ids = torch.randint(0, 512, (2, 420), generator=torch.Generator().manual_seed(2)).cuda()
    logits = {}
    for backend in ("torch", "triton"):
        cache = KittyCache(model.config, preset, backend=backend)
        with torch.no_grad():
            model(ids[:, :150], past_key_values=cache, use_cache=True)
            steps = [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1] for t in range(150, 420)]
        logits[backend] = torch.stack(steps, 1).float()  # (B, steps, vocab)
    first = (logits["torch"][:, 0] - logits["triton"][:, 0]).abs().max().item()
    diff = (logits["torch"] - logits["triton"]).abs().max().item()
    scale = logits["torch"].abs().max().item()
    agree = (logits["torch"].argmax(-1) == logits["triton"].argmax(-1)).float().mean().item()
    print(f"{kind} {preset}: first-step max |logit diff| {first:.4f}, over all steps {diff:.4f} (logit scale {scale:.2f}), argmax agreement {agree:.4f}")
    assert first <= LOGIT_RTOL * scale
    assert agree >= 0.97


def test_cache_uses_the_fused_kernel_on_cuda(monkeypatch):
    import kernels

    model = tiny_model("llama")
    calls = []
    real = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = KittyCache(model.config, "kitty")  # backend="auto"
    generate(model, cache, torch.randint(0, 512, (1, 40)).cuda(), 8)
    assert len(calls) >= 8 * model.config.num_hidden_layers - 2 * model.config.num_hidden_layers
