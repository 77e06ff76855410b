"""Stand-ins for the hub models vLLM's scheduler tests name, in an offline
Hugging Face cache.

vLLM's `tests/v1/core/utils.create_scheduler` builds a `ModelConfig` for
`facebook/opt-125m` (the config is read; no weight is loaded) and a
`StructuredOutputManager`, which loads the tokenizer. The matrix runs
offline, so this writes, under `HF_HOME`, a hub-cache snapshot with the
model's real configuration (transformers' `OPTConfig` defaults are
opt-125m's) and a word-level tokenizer of the same vocabulary size. The
scheduler reads the config's shape only (max_model_len, the dtype, whether it
is multimodal): its decisions are those it makes for the real model.

Models not written here (multimodal and Qwen checkpoints a few tests name)
are missing offline: those tests fail alike with vLLM's own class and with
the hooked one, and the matrix reports them as not runnable offline.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# Pretend revision: any 40-hex name works for an offline snapshot.
REVISION = hashlib.sha1(b"vllm-runbook compat stand-in").hexdigest()


def _tokenizer(snapshot: Path, vocab_size: int, specials: dict[str, int]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(specials)
    for i in range(vocab_size):
        if i not in vocab.values():
            vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="</s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(str(snapshot))


def _opt(snapshot: Path, **overrides: object) -> None:
    from transformers import OPTConfig

    config = OPTConfig(**overrides)  # type: ignore[arg-type]
    config.architectures = ["OPTForCausalLM"]
    config.torch_dtype = "float16"
    config.save_pretrained(str(snapshot))
    _tokenizer(snapshot, config.vocab_size, {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3})


MODELS = {
    "facebook/opt-125m": lambda s: _opt(s),
    "facebook/opt-350m": lambda s: _opt(
        s,
        hidden_size=1024,
        num_hidden_layers=24,
        ffn_dim=4096,
        num_attention_heads=16,
        word_embed_proj_dim=512,
    ),
}


def write_hf_cache(hf_home: Path) -> Path:
    """The stand-ins under `hf_home/hub` (idempotent); returns `hf_home`."""
    for repo, build in MODELS.items():
        base = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
        snapshot = base / "snapshots" / REVISION
        if (snapshot / "config.json").is_file():
            continue
        snapshot.mkdir(parents=True, exist_ok=True)
        build(snapshot)
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / "main").write_text(REVISION)
    return hf_home


if __name__ == "__main__":
    import sys

    print(write_hf_cache(Path(sys.argv[1])))
