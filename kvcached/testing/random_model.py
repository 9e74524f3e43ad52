"""Small random-weight Hugging Face checkpoints, made locally, for tests and demos.

No model can be downloaded where kvcached is tested, so engine tests build one: a
Qwen3- or Llama-shaped config, weights drawn from a seeded normal distribution, and a
byte-level BPE tokenizer trained here on a seeded made-up language. Engines load the
folder offline like any checkpoint, and with a fixed seed two builds are identical, so
greedy tokens are exactly comparable across processes.

Random weights make attention matter little at the default scale (outputs collapse to
a few repeated tokens), so `attention_gain` scales the query/key projections up: the
attention pattern then depends sharply on the cached keys, and a wrong KV block changes
the output. Tests that compare tokens rely on that to show that they can fail.

Needs `torch`, `transformers`, `tokenizers` and `safetensors` (all come with vLLM).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only model (Qwen3 or Llama architecture)."""

    arch: str = "qwen3"
    layers: int = 2
    hidden: int = 128
    intermediate: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    vocab: int = 1024
    max_positions: int = 4096


TINY = ModelShape()


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    """A seeded pseudo-language (syllable words, Zipf-like frequencies, some digits)."""
    rng = random.Random(seed)
    starts = ["", "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "st", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    ends = ["", "", "n", "r", "s", "t", "l"]
    words = sorted(
        {
            "".join(
                rng.choice(starts) + rng.choice(vowels) + rng.choice(ends)
                for _ in range(rng.randint(1, 3))
            )
            for _ in range(4000)
        }
    )
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    text = []
    for _ in range(lines):
        sentence = rng.choices(words, weights=weights, k=rng.randint(4, 16))
        text.append(" ".join(sentence) + rng.choice([".", ",", "?", "!", ""]))
    text.append("0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } < > ; : ' \" # % & _ |")
    return text


def _tokenizer(folder: Path, vocab: int, seed: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(seed), trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|pad|>",
        model_max_length=32768,
    )
    missing = vocab - len(tokenizer)
    if missing > 0:  # the corpus ran out of merges: fill the vocabulary up
        tokenizer.add_tokens([f"<|unused_{i}|>" for i in range(missing)])
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer.save_pretrained(folder)
    return tokenizer


def _config(shape: ModelShape, tokenizer: Any, dtype: str) -> dict[str, Any]:
    arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[shape.arch]
    return {
        "architectures": [arch],
        "model_type": shape.arch,
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def _weights(shape: ModelShape, seed: int, dtype: str, attention_gain: float) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, d = shape.hidden, shape.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (shape.vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (shape.vocab, h),
    }
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (shape.heads * d, h),
            p + "self_attn.k_proj.weight": (shape.kv_heads * d, h),
            p + "self_attn.v_proj.weight": (shape.kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, shape.heads * d),
            p + "mlp.gate_proj.weight": (shape.intermediate, h),
            p + "mlp.up_proj.weight": (shape.intermediate, h),
            p + "mlp.down_proj.weight": (h, shape.intermediate),
        }
        if shape.arch == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    tensors = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            value = torch.ones(shapes[name])
            if attention_gain != 1.0 and ("q_norm" in name or "k_norm" in name):
                value *= attention_gain**0.5  # sharpen attention (Qwen3 normalizes q and k)
        else:
            value = torch.empty(shapes[name]).normal_(0.0, 0.02, generator=gen)
            if attention_gain != 1.0 and (".q_proj." in name or ".k_proj." in name):
                value *= attention_gain**0.5
            if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
                value *= 50.0  # token identity dominates the residual stream
        tensors[name] = value.to(getattr(torch, dtype)).contiguous()
    return tensors


def make_random_model(
    folder: str | Path,
    shape: ModelShape = TINY,
    *,
    seed: int = 0,
    dtype: str = "float32",
    attention_gain: float = 16.0,
) -> Path:
    """Write config, tokenizer and random weights to `folder` (created); returns it.

    The same arguments always give the same files. An existing folder with a matching
    `kvcached-model.json` is reused as is."""
    from safetensors.torch import save_file

    folder = Path(folder)
    recipe = {"shape": shape.__dict__, "seed": seed, "dtype": dtype, "gain": attention_gain}
    stamp = folder / "kvcached-model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(folder, shape.vocab, seed)
    (folder / "config.json").write_text(json.dumps(_config(shape, tokenizer, dtype), indent=1))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id})
    )
    save_file(
        _weights(shape, seed, dtype, attention_gain),
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    stamp.write_text(json.dumps(recipe))
    return folder
