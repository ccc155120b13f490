"""KV block sizes from model shapes: one table, one formula.

Bytes of KV cache per token = 2 (K and V) x layers x kv_heads x head_dim x
dtype bytes; a KV block holds ``tokens_per_block`` tokens. Shapes come from
each model's Hugging Face ``config.json`` (``num_hidden_layers``,
``num_key_value_heads``, ``hidden_size / num_attention_heads``).
"""

from __future__ import annotations

from dataclasses import dataclass

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_TOKENS_PER_BLOCK = 128  # the HyMCache paper's KV block: 128 tokens


@dataclass(frozen=True)
class KvModel:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    source: str

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
    KvModel("llama-3.1-8b", 32, 8, 128, 2, _HF.format("meta-llama/Llama-3.1-8B")),
    # 80 layers, 8 KV heads, head_dim 8192/64 = 128, bf16: 320 KiB/token, 40 MiB per block
    KvModel("llama-3.1-70b", 80, 8, 128, 2, _HF.format("meta-llama/Llama-3.1-70B")),
    # 32 layers, 32 KV heads (MHA), head_dim 128, fp16: 512 KiB/token, 64 MiB per block (paper's 64 MB blocks)
    KvModel("llama-2-7b", 32, 32, 128, 2, _HF.format("meta-llama/Llama-2-7b-hf")),
    # 64 layers, 8 KV heads, head_dim 5120/40 = 128, bf16: 256 KiB/token, 32 MiB per block
    KvModel("qwen2.5-32b", 64, 8, 128, 2, _HF.format("Qwen/Qwen2.5-32B")),
    # 48 layers, 56 heads (MHA), head_dim 7168/56 = 128, fp16: 1.3125 MiB/token, 168 MiB per block (paper's 168 MB blocks)
    KvModel("opt-30b", 48, 56, 128, 2, _HF.format("facebook/opt-30b")),
)}


def get_model(name: str) -> KvModel:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"model {name!r} is not in the model table; known: {', '.join(MODELS)}") from None


_UNITS = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1 << 40}


def parse_bytes(text: str | int, what: str = "size") -> int:
    """``"64MiB"`` -> 67108864. Binary units only (KV sizes are powers of two), named in errors."""
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip().lower().replace(" ", "")
        number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(number):]
        if unit not in _UNITS or not number:
            raise ValueError(f"{what} = {text!r} is not a byte count; use an integer with an optional unit "
                             f"KiB, MiB, GiB or TiB (e.g. 64MiB)")
        try:
            value = int(float(number) * _UNITS[unit])
        except ValueError:
            raise ValueError(f"{what} = {text!r} is not a byte count (e.g. 64MiB)") from None
    if value <= 0:
        raise ValueError(f"{what} = {text!r} must be positive")
    return value
