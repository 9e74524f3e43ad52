"""Tiny random-weight mlx-lm models with a locally trained tokenizer, built offline.

No model can be downloaded where kvcached is tested, so tests, benchmarks and a Mac
owner's validation runs build their own: a Qwen3 or Llama of a few layers with random
weights (seeded), saved as an mlx-lm model folder that `mlx_lm.load(folder)` reads.
Random weights make greedy tokens exactly comparable between two caches; they say
nothing about quality. To make one to try `serve-mlx` with:
`kvcached make-tiny-model DIR` (or `python -m kvcached.engines.mlx_lm.tiny DIR`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ARCHITECTURES = ("qwen3", "llama")

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "memory follows use and idle models give their memory back",
    "several models share one budget on one machine",
    "a key value cache grows as tokens arrive and shrinks when sequences end",
    "pages are charged to the ledger before they are created",
] * 20


def model_config(
    architecture: str,
    *,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 256,
    context: int = 32768,
) -> dict[str, Any]:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r}; accepted: {', '.join(ARCHITECTURES)}")
    config: dict[str, Any] = {
        "model_type": architecture,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "head_dim": hidden // heads,
    }
    if architecture == "llama":
        config["attention_bias"] = False
        config["mlp_bias"] = False
    return config


def build_tokenizer(folder: Path, vocab: int) -> None:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    from tokenizers import decoders

    tokenizer.decoder = decoders.ByteLevel()
    fast_class: Any = transformers.PreTrainedTokenizerFast
    fast: Any = fast_class(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(str(folder))


def build_model(
    folder: str | Path,
    architecture: str = "qwen3",
    seed: int = 0,
    weight_scale: float = 2.0,
    **sizes: Any,
) -> Path:
    """Write a tiny random model of `architecture` to `folder` (created); return it.

    Weights (all but the norms) are scaled by `weight_scale`: at mlx-lm's default
    initialisation a tiny model repeats one token whatever its context, so a broken
    cache would go unnoticed; at 2x its tokens depend on what attention reads."""
    import mlx.core as mx
    from mlx import utils
    from mlx_lm.utils import _get_classes

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    config = model_config(architecture, **sizes)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    flatten: Any = utils.tree_flatten
    weights: dict[str, Any] = {
        name: value if "norm" in name else value * weight_scale
        for name, value in flatten(model.parameters())
    }
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    build_tokenizer(path, config["vocab_size"])
    return path


def main(argv: list[str] | None = None) -> Path:
    """`python -m kvcached.engines.mlx_lm.tiny DIR [--arch qwen3|llama] [--seed N]`:
    write a tiny random model to DIR (no download) and say how to serve it."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvcached.engines.mlx_lm.tiny",
        description="Write a tiny random-weight mlx-lm model (a few MB, no download).",
    )
    parser.add_argument("folder", help="where to write it (created)")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_model(args.folder, args.arch, seed=args.seed)
    print(f"wrote a tiny random {args.arch} model to {path} (random weights: text is noise)")
    print(f"serve it: kvcached serve-mlx {path}")
    return path


if __name__ == "__main__":
    main()
