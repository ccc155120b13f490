"""GPT-2 style byte-level BPE read from the GGUF's ``tokenizer.ggml.*`` fields.

The pre-tokenizer is GPT-2's split expressed with the standard ``re`` module
(letters as ``[^\\W\\d_]``), with digits split one by one as SmolLM2's does.
Control tokens (``<|im_start|>`` ...) are matched verbatim before BPE.
"""

from __future__ import annotations

import re
from functools import lru_cache

CONTROL_TOKEN_TYPE = 3
_PRETOKENIZE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d| ?[^\s\w]+|\s+(?!\S)|\s+""")


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


class Tokenizer:
    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int], eos_id: int):
        self.tokens = tokens
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.control = {t: i for i, (t, ty) in enumerate(zip(tokens, token_types)) if ty == CONTROL_TOKEN_TYPE}
        self.eos_id = eos_id
        self._b2u = _byte_to_unicode()
        self._u2b = {u: b for b, u in self._b2u.items()}
        self._control_re = re.compile("|".join(re.escape(t) for t in sorted(self.control, key=len, reverse=True)))
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        def strings(key):
            f = reader.fields[key]
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

        f = reader.fields["tokenizer.ggml.token_type"]
        types = [int(f.parts[i][0]) for i in f.data]
        eos = int(reader.fields["tokenizer.ggml.eos_token_id"].contents())
        return cls(strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges"), types, eos)

    def _bpe(self, word: str) -> list[int]:
        if word in self._cache:
            return self._cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids = [self.ids[p] for p in parts]
        self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        pos = 0
        for m in list(self._control_re.finditer(text)) + [None]:
            chunk = text[pos:m.start()] if m else text[pos:]
            for piece in _PRETOKENIZE.findall(chunk):
                out.extend(self._bpe("".join(self._b2u[b] for b in piece.encode("utf-8"))))
            if m:
                out.append(self.control[m.group()])
                pos = m.end()
        return out

    def decode(self, ids) -> str:
        data = bytearray()
        for i in ids:
            tok = self.tokens[int(i)]
            if tok in self.control:
                data += tok.encode()
            else:
                data += bytes(self._u2b[c] for c in tok)
        return data.decode("utf-8", errors="replace")

    def chat_prompt(self, user_text: str) -> str:
        """SmolLM2-Instruct's chat template for one user turn."""
        return (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            f"<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n"
        )
