"""Create a tiny random-weight Llama model and tokenizer on local disk.

Used by the tests, the demo and the benchmarks: no model hub, no network.
The shape is the smallest that vLLM's CPU backend accepts (head_dim 64).
Requires `torch`, `transformers` and `tokenizers`, which come with vLLM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

VOCAB_SIZE = 512
# Words "w0".."w{N}" map one-to-one to token ids, so a prompt of N words is
# exactly N tokens: tests build prompts of known length from token ids.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def _build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(len(SPECIAL_TOKENS), VOCAB_SIZE):
        vocab[f"w{i}"] = i
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )
    fast.save_pretrained(str(path))


def create_tiny_model(path: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write a random-weight Llama (hidden 256, 2 layers, vocab 512) to `path`.

    Idempotent: an existing complete model directory is reused.
    """
    path = Path(path)
    marker = path / ".vllm-runbook-tiny-model"
    if marker.exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(str(path), safe_serialization=True)
    _build_tokenizer(path)
    marker.write_text(json.dumps({"vocab_size": VOCAB_SIZE, "seed": seed}))
    return path


def prompt_token_ids(length: int, offset: int = 0) -> list[int]:
    """A prompt of exactly `length` ordinary tokens (no special tokens)."""
    first = len(SPECIAL_TOKENS)
    span = VOCAB_SIZE - first
    return [first + (offset + i) % span for i in range(length)]


if __name__ == "__main__":
    import sys

    print(create_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
