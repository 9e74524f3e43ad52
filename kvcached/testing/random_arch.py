"""Random-weight checkpoints of the architectures in the compatibility matrix.

`random_model.py` writes Qwen3/Llama checkpoints by hand; the other rows of
`docs/compatibility.md` have structures too varied to spell out tensor by tensor
(mixture of experts, Gated DeltaNet, per-layer embeddings, latent attention, chunked
local attention), so this module lets the installed transformers build them: a config
holding the published values of the representative model, `from_config` with a seeded
generator, then the same sharpening as `random_model.py` (query/key projections scaled
by `attention_gain`, embeddings by 50) so that a wrong KV block changes greedy tokens.

`ARCHITECTURES` names each row. `real` is the representative's own config (the values
its Hugging Face `config.json` publishes, the fields that shape the KV cache at least);
`scaled` is the CPU version: fewer and narrower layers, the same structure (the layer
pattern, sliding windows, which layers share KV, per-layer KV shapes, MLA dims); `gpu`
keeps the real widths and KV shapes with fewer layers, experts and vocabulary. The
tokenizer is `random_model`'s, trained here, so no file is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

#: the vocabulary of every scaled model (the locally trained tokenizer's size)
SCALED_VOCAB = 1024


@dataclass(frozen=True)
class Architecture:
    """One row of the matrix: what it is, and its real and CPU-scaled configs."""

    name: str  # the row's key, e.g. "sliding-window-hybrid"
    representative: str  # the published model whose config this follows
    architecture: str  # the Hugging Face / vLLM architecture class
    why_hard: str
    real: dict[str, Any]
    scaled: dict[str, Any]
    #: fields the builder sets on every config (model type, architecture)
    common: dict[str, Any] = field(default_factory=dict)
    #: the dtype engines run it in on CPU (vLLM-CPU's MoE kernels take no float32)
    cpu_dtype: str = "float32"
    #: what the H200 run changes in `real` so a model builds and starts in seconds:
    #: fewer layers (whole periods of the layer pattern), experts and vocabulary; the
    #: per-layer KV shapes, windows and sharing stay the real ones
    gpu_trim: dict[str, Any] = field(default_factory=dict)
    #: the H200 checkpoint's outer config where the device's vLLM registers only a
    #: model's multimodal class: the text config goes under ``text_config`` beside these
    #: fields (a tiny vision tower, which vLLM skips with ``language_model_only``)
    gpu_composite: dict[str, Any] = field(default_factory=dict)

    def class_name(self, *, scale: str) -> str:
        """The model class a checkpoint of this `scale` names."""
        if scale == "gpu" and self.gpu_composite:
            return str(self.gpu_composite["architectures"][0])
        return self.architecture

    def config(self, *, scale: str) -> dict[str, Any]:
        """`real`, `scaled` (CPU) or `gpu` (real KV shapes, trimmed depth)."""
        if scale == "real":
            return {**self.common, **self.real}
        if scale == "scaled":
            return {**self.common, **self.scaled}
        if scale == "gpu":
            return {**self.common, **self.real, "vocab_size": 32768, **self.gpu_trim}
        raise ValueError(f"scale={scale!r}: accepted are 'real', 'scaled' and 'gpu'")


def _alternating(first: T, second: T, every: int, layers: int) -> list[T]:
    """`every - 1` layers of `first`, then one of `second`, repeated over `layers`."""
    return [second if (i + 1) % every == 0 else first for i in range(layers)]


#: GPT-OSS's published rotary embedding (YaRN over a 4,096-token original context)
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 4096,
    "truncate": False,
}

#: Llama 4 Scout's published rotary embedding (Llama 3's frequency bands, 16x over an
#: 8,192-token original context); the layers without RoPE ignore it
_LLAMA4_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 16.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}

#: DeepSeek-V3's published rotary embedding (YaRN, 40x over a 4,096-token context)
_DEEPSEEK_V3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}

#: the Gated DeltaNet layers Qwen3-Next and Qwen3.5 publish alike
_QWEN_GATED_DELTANET = {
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture(
            name="standard-gqa",
            representative="Qwen/Qwen3-8B",
            gpu_trim={"num_hidden_layers": 8},
            architecture="Qwen3ForCausalLM",
            why_hard="baseline",
            common={"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
            real={
                "hidden_size": 4096,
                "intermediate_size": 12288,
                "num_hidden_layers": 36,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 151936,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "max_position_embeddings": 40960,
            },
            scaled={
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "vocab_size": SCALED_VOCAB,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "max_position_embeddings": 4096,
            },
        ),
        Architecture(
            name="sliding-window-hybrid",
            representative="openai/gpt-oss-20b",
            gpu_trim={
                "num_hidden_layers": 4,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "num_local_experts": 4,
            },
            cpu_dtype="bfloat16",
            architecture="GptOssForCausalLM",
            why_hard="two KV groups (sliding window, full) with different lifetimes; MoE",
            common={
                "model_type": "gpt_oss",
                "architectures": ["GptOssForCausalLM"],
                "swiglu_limit": 7.0,  # the real config's; SGLang's GPT-OSS reads it
            },
            real={
                "hidden_size": 2880,
                "intermediate_size": 2880,
                "num_hidden_layers": 24,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "head_dim": 64,
                "num_local_experts": 32,
                "num_experts_per_tok": 4,
                "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 12,
                "vocab_size": 201088,
                "max_position_embeddings": 131072,
                "rope_parameters": _GPT_OSS_ROPE,
            },
            scaled={
                "hidden_size": 128,
                "intermediate_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "vocab_size": SCALED_VOCAB,
                "max_position_embeddings": 4096,
                "rope_parameters": _GPT_OSS_ROPE,
            },
        ),
        Architecture(
            name="hybrid-linear-attention",
            representative="Qwen/Qwen3.5-9B",
            gpu_trim={
                "num_hidden_layers": 8,
                "layer_types": _alternating("linear_attention", "full_attention", 4, 8),
            },
            architecture="Qwen3_5ForCausalLM",
            cpu_dtype="bfloat16",  # vLLM-CPU's Gated DeltaNet kernels take bf16 only
            # vLLM 0.26 registers Qwen3.5 only as Qwen3_5ForConditionalGeneration (the
            # published checkpoints' class), and checks the config is its composite one
            gpu_composite={
                "model_type": "qwen3_5",
                "architectures": ["Qwen3_5ForConditionalGeneration"],
                "vision_config": {
                    "depth": 1,
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_heads": 2,
                    "out_hidden_size": 4096,  # the text model's hidden size
                },
            },
            why_hard="3 Gated DeltaNet layers (no KV, a state cache) to 1 attention layer",
            # SGLang's Qwen3.5 config reads the pattern from full_attention_interval, as
            # its Qwen3-Next one does (the published text_config has both)
            common={
                "model_type": "qwen3_5_text",
                "architectures": ["Qwen3_5ForCausalLM"],
                "full_attention_interval": 4,
            },
            real={
                "hidden_size": 4096,
                "intermediate_size": 12288,
                "num_hidden_layers": 32,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "head_dim": 256,
                **_QWEN_GATED_DELTANET,
                "layer_types": _alternating("linear_attention", "full_attention", 4, 32),
                "vocab_size": 248320,
            },
            # vLLM-CPU's Gated DeltaNet kernel takes 64- or 128-wide heads (as for
            # Qwen3-Next below); twice as many value heads as key heads, as published
            scaled={
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "linear_num_key_heads": 1,
                "linear_num_value_heads": 2,
                "linear_key_head_dim": 64,
                "linear_value_head_dim": 64,
                "linear_conv_kernel_dim": 4,
                "layer_types": _alternating("linear_attention", "full_attention", 4, 4),
                "vocab_size": SCALED_VOCAB,
            },
        ),
        Architecture(
            # Qwen3.5's Gated DeltaNet layers and 3:1 pattern in the class they came
            # from, with MoE (vLLM-CPU imports this class without torchvision; Qwen3.5's
            # needs tests/standins/ there)
            name="hybrid-linear-attention-moe",
            representative="Qwen/Qwen3-Next-80B-A3B-Instruct",
            gpu_trim={
                "num_hidden_layers": 8,
                "layer_types": _alternating("linear_attention", "full_attention", 4, 8),
                "num_experts": 8,
                "num_experts_per_tok": 2,
            },
            cpu_dtype="bfloat16",
            architecture="Qwen3NextForCausalLM",
            why_hard="Qwen3.5's 3:1 Gated DeltaNet : attention pattern (a state cache in "
            "the KV block pool) in Qwen3-Next's class, with MoE",
            # SGLang's Qwen3NextConfig derives the layer pattern from the published
            # config's full_attention_interval (every 4th layer), not from layer_types
            common={
                "model_type": "qwen3_next",
                "architectures": ["Qwen3NextForCausalLM"],
                "full_attention_interval": 4,
            },
            real={
                "hidden_size": 2048,
                "intermediate_size": 5120,
                "num_hidden_layers": 48,
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
                "head_dim": 256,
                **_QWEN_GATED_DELTANET,
                "num_experts": 512,
                "num_experts_per_tok": 10,
                "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512,
                "layer_types": _alternating("linear_attention", "full_attention", 4, 48),
                "vocab_size": 151936,
            },
            # vLLM-CPU's Gated DeltaNet kernel takes 64- or 128-wide heads, and vLLM
            # sizes an attention block to hold one layer's state: one 64-wide head
            # pair keeps blocks at 128 tokens, so the 300-token prompts fill cached
            # blocks (of state and of KV) that the corruption check can swap
            scaled={
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "linear_num_key_heads": 1,
                "linear_num_value_heads": 1,
                "linear_key_head_dim": 64,
                "linear_value_head_dim": 64,
                "linear_conv_kernel_dim": 4,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 64,
                "shared_expert_intermediate_size": 64,
                "layer_types": _alternating("linear_attention", "full_attention", 4, 4),
                "vocab_size": SCALED_VOCAB,
            },
        ),
        Architecture(
            name="cross-layer-kv-sharing",
            representative="google/gemma-4-E2B-it",
            gpu_trim={
                "num_hidden_layers": 10,
                "num_kv_shared_layers": 5,
                "layer_types": _alternating("sliding_attention", "full_attention", 5, 10),
                "vocab_size_per_layer_input": 32768,
            },
            architecture="Gemma4ForCausalLM",
            why_hard="the last layers read earlier layers' KV; sliding + full, 256/512 dims",
            common={"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"]},
            real={
                "hidden_size": 1536,
                "intermediate_size": 6144,
                "num_hidden_layers": 35,
                "num_attention_heads": 8,
                "num_key_value_heads": 1,
                "head_dim": 256,
                "global_head_dim": 512,
                "sliding_window": 512,
                "num_kv_shared_layers": 20,
                "hidden_size_per_layer_input": 256,
                "final_logit_softcapping": 30.0,
                "layer_types": _alternating("sliding_attention", "full_attention", 5, 35),
                "vocab_size": 262144,
                "vocab_size_per_layer_input": 262144,
            },
            scaled={
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 5,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "global_head_dim": 64,
                "sliding_window": 128,
                "num_kv_shared_layers": 2,
                "hidden_size_per_layer_input": 16,
                "final_logit_softcapping": 30.0,
                "layer_types": [
                    "sliding_attention",
                    "sliding_attention",
                    "full_attention",
                    "sliding_attention",
                    "full_attention",
                ],
                "vocab_size": SCALED_VOCAB,
                "vocab_size_per_layer_input": SCALED_VOCAB,
            },
        ),
        Architecture(
            name="heterogeneous-kv-groups",
            representative="google/gemma-4-12B-it",
            gpu_trim={
                "num_hidden_layers": 6,
                "layer_types": _alternating("sliding_attention", "full_attention", 6, 6),
            },
            architecture="Gemma4ForCausalLM",
            why_hard="per-layer KV head count and head dim (sliding 256-dim, global 512-dim "
            "layers with K = V and fewer KV heads)",
            common={"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"]},
            real={
                "hidden_size": 3840,
                "intermediate_size": 15360,
                "num_hidden_layers": 48,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "head_dim": 256,
                "global_head_dim": 512,
                "num_global_key_value_heads": 4,
                "attention_k_eq_v": True,
                "sliding_window": 1024,
                "final_logit_softcapping": 30.0,
                "hidden_size_per_layer_input": 0,
                "layer_types": _alternating("sliding_attention", "full_attention", 6, 48),
                "vocab_size": 262144,
            },
            scaled={
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 6,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "global_head_dim": 64,
                "num_global_key_value_heads": 1,
                "attention_k_eq_v": True,
                "sliding_window": 128,
                "final_logit_softcapping": 30.0,
                "hidden_size_per_layer_input": 0,
                "layer_types": _alternating("sliding_attention", "full_attention", 3, 6),
                "vocab_size": SCALED_VOCAB,
            },
        ),
        Architecture(
            name="mla",
            representative="deepseek-ai/DeepSeek-V2-Lite",
            gpu_trim={"num_hidden_layers": 4, "n_routed_experts": 8},
            cpu_dtype="bfloat16",
            architecture="DeepseekV2ForCausalLM",
            why_hard="one compressed latent (kv_lora_rank + rope dims) per token and layer",
            common={
                "model_type": "deepseek_v2",
                "architectures": ["DeepseekV2ForCausalLM"],
                # V2-Lite's router: greedy top-k over one expert group
                "topk_method": "greedy",
                "n_group": 1,
                "topk_group": 1,
                "routed_scaling_factor": 1.0,
                "scoring_func": "softmax",
                "norm_topk_prob": False,
                "moe_layer_freq": 1,  # the real config's; SGLang's DeepSeek reads it
            },
            real={
                "hidden_size": 2048,
                "intermediate_size": 10944,
                "moe_intermediate_size": 1408,
                "num_hidden_layers": 27,
                "num_attention_heads": 16,
                "num_key_value_heads": 16,
                "kv_lora_rank": 512,
                "q_lora_rank": None,
                "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64,
                "v_head_dim": 128,
                "n_routed_experts": 64,
                "n_shared_experts": 2,
                "num_experts_per_tok": 6,
                "first_k_dense_replace": 1,
                "vocab_size": 102400,
            },
            scaled={
                "hidden_size": 128,
                "intermediate_size": 256,
                "moe_intermediate_size": 64,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                # the real latent (512 + 64 = 576 per token): vLLM-CPU's MLA takes only 576
                "kv_lora_rank": 512,
                "q_lora_rank": None,
                "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 64,
                "v_head_dim": 32,
                "n_routed_experts": 4,
                "n_shared_experts": 1,
                "num_experts_per_tok": 2,
                "first_k_dense_replace": 1,
                "vocab_size": SCALED_VOCAB,
            },
        ),
        Architecture(
            # DeepSeek-V3's class and config path: the same MLA cache as V2-Lite's row,
            # reached through a low-rank query and V3's router (sigmoid scores with a
            # correction bias, the best experts of the best groups, scaled outputs)
            name="mla-large-moe",
            representative="deepseek-ai/DeepSeek-V3",
            gpu_trim={"num_hidden_layers": 4, "first_k_dense_replace": 1, "n_routed_experts": 16},
            cpu_dtype="bfloat16",
            architecture="DeepseekV3ForCausalLM",
            why_hard="MLA (576-wide latent per token and layer) behind a low-rank query; "
            "256 experts routed by group (noaux_tc), dense first layers",
            common={
                "model_type": "deepseek_v3",
                "architectures": ["DeepseekV3ForCausalLM"],
                # V3's router, read by vLLM (and SGLang) though transformers' class
                # declares only the group counts
                "topk_method": "noaux_tc",
                "scoring_func": "sigmoid",
                "norm_topk_prob": True,
                "routed_scaling_factor": 2.5,
                "moe_layer_freq": 1,
                "rope_parameters": _DEEPSEEK_V3_ROPE,
            },
            real={
                "hidden_size": 7168,
                "intermediate_size": 18432,
                "moe_intermediate_size": 2048,
                "num_hidden_layers": 61,
                "num_attention_heads": 128,
                "num_key_value_heads": 128,
                "kv_lora_rank": 512,
                "q_lora_rank": 1536,
                "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64,
                "v_head_dim": 128,
                "n_routed_experts": 256,
                "n_shared_experts": 1,
                "num_experts_per_tok": 8,
                "n_group": 8,
                "topk_group": 4,
                "first_k_dense_replace": 3,
                "vocab_size": 129280,
                "max_position_embeddings": 163840,
            },
            # 8 experts in 4 groups of 2 (V3 scores a group by its best two), 2 groups
            # kept: routing by group still excludes experts; one dense layer first
            scaled={
                "hidden_size": 128,
                "intermediate_size": 256,
                "moe_intermediate_size": 64,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                # the real latent (512 + 64 = 576 per token): vLLM-CPU's MLA takes only 576
                "kv_lora_rank": 512,
                "q_lora_rank": 64,
                "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 64,
                "v_head_dim": 32,
                "n_routed_experts": 8,
                "n_shared_experts": 1,
                "num_experts_per_tok": 2,
                "n_group": 4,
                "topk_group": 2,
                "first_k_dense_replace": 1,
                "vocab_size": SCALED_VOCAB,
                "max_position_embeddings": 163840,
            },
        ),
        Architecture(
            # the text model of Scout (its checkpoints are Llama4ForConditionalGeneration;
            # vLLM serves the text part as this class): RoPE layers attend within their
            # chunk only, every 4th layer has no RoPE and attends to everything
            name="chunked-local-attention",
            representative="meta-llama/Llama-4-Scout-17B-16E-Instruct",
            gpu_trim={
                "num_hidden_layers": 4,
                "no_rope_layers": _alternating(1, 0, 4, 4),
                "num_local_experts": 4,
            },
            cpu_dtype="bfloat16",
            architecture="Llama4ForCausalLM",
            why_hard="chunked local attention (3 of 4 layers see only their chunk, whose "
            "older blocks are freed as it moves on) beside full attention without RoPE; MoE",
            common={
                "model_type": "llama4_text",
                "architectures": ["Llama4ForCausalLM"],
                "use_qk_norm": True,
                "attn_temperature_tuning": True,
                "floor_scale": 8192,
                "attn_scale": 0.1,
                "rope_parameters": _LLAMA4_ROPE,
            },
            real={
                "hidden_size": 5120,
                "intermediate_size": 8192,
                "intermediate_size_mlp": 16384,
                "num_hidden_layers": 48,
                "num_attention_heads": 40,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "num_local_experts": 16,
                "num_experts_per_tok": 1,
                "interleave_moe_layer_step": 1,
                "attention_chunk_size": 8192,
                # published empty: transformers derives it, a NoPE layer every 4th
                "no_rope_layers": _alternating(1, 0, 4, 48),
                "vocab_size": 202048,
                "max_position_embeddings": 10485760,
            },
            # a 256-token chunk (two 128-token CPU blocks): the 300-token prompts cross
            # its boundary, so the chunked group frees its first blocks while the full
            # group keeps them, and a prefix hit gives it null blocks in their place
            scaled={
                "hidden_size": 128,
                "intermediate_size": 64,
                "intermediate_size_mlp": 256,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "num_local_experts": 4,
                "num_experts_per_tok": 1,
                "interleave_moe_layer_step": 1,
                "attention_chunk_size": 256,
                "no_rope_layers": _alternating(1, 0, 4, 4),
                "vocab_size": SCALED_VOCAB,
                # past the rotary embedding's original 8,192 (transformers checks),
                # short of the real 10M positions vLLM would tabulate
                "max_position_embeddings": 131072,
            },
        ),
    )
}


def _sharpen(name: str, value: Any, attention_gain: float) -> Any:
    """Scale query/key projections (and q/k norms) by the gain, embeddings by 50."""
    root = attention_gain**0.5
    # a low-rank query (DeepSeek-V3's q_lora_rank) is normalised between its two
    # projections, so only the second one's scale reaches the scores
    projections = (".q_proj.", ".k_proj.", ".q_a_proj.", ".q_b_proj.", ".kv_a_proj")
    if any(part in name for part in projections):
        return value * root
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return value * root if float(value.abs().mean()) > 0.5 else value + (root - 1.0)
    if "embed_tokens" in name or name.startswith("lm_head"):
        return value * 50.0
    return value


def make_arch_model(
    folder: str | Path,
    name: str,
    *,
    scale: str = "scaled",
    seed: int = 0,
    dtype: str = "float32",
    attention_gain: float = 16.0,
) -> Path:
    """Write the row `name`'s config, tokenizer and random weights to `folder`.

    The same arguments give the same files; a folder whose `kvcached-model.json` matches
    is reused as is. An unknown `name` is an error listing the rows."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; accepted: {', '.join(ARCHITECTURES)}")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvcached.testing.random_model import _tokenizer

    arch = ARCHITECTURES[name]
    folder = Path(folder)
    recipe = {"arch": name, "scale": scale, "seed": seed, "dtype": dtype, "gain": attention_gain}
    stamp = folder / "kvcached-model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    values = arch.config(scale=scale)
    tokenizer = _tokenizer(folder, SCALED_VOCAB, seed)  # token ids < the smallest vocab
    values |= {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values)
    torch.manual_seed(seed)
    if scale == "gpu" and arch.gpu_composite:
        from transformers import AutoModelForImageTextToText

        outer = dict(arch.gpu_composite)
        composite = AutoConfig.for_model(
            outer.pop("model_type"),
            text_config=config.to_dict(),
            tie_word_embeddings=False,
            dtype=dtype,
            **outer,
        )
        model = AutoModelForImageTextToText.from_config(composite, dtype=getattr(torch, dtype))  # type: ignore[no-untyped-call]
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            param.copy_(_sharpen(param_name, param, attention_gain))
    model.save_pretrained(folder)
    if scale == "gpu" and values.get("num_kv_shared_layers"):
        _add_shared_layer_key_norms(folder)
    stamp.write_text(json.dumps(recipe))
    return folder


def _add_shared_layer_key_norms(folder: Path) -> None:
    """Give each KV-shared layer of a Gemma 4 checkpoint a key norm (ones, the shape of
    its query norm). Such a layer computes no keys, and the transformers that vLLM 0.26
    reads Gemma 4 with (5.12) saves none for it, but vLLM 0.26 declares one in every
    layer and refuses a checkpoint that lacks it ("Following weights were not
    initialized from checkpoint: {'model.layers.5.self_attn.k_norm.weight', ...}")."""
    import torch
    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    names = set(index["weight_map"]) if index else set(load_file(folder / files[0]))
    for file in files:
        tensors = load_file(folder / file)
        added = {
            name.replace(".q_norm.", ".k_norm."): torch.ones_like(weight)
            for name, weight in tensors.items()
            if name.endswith("self_attn.q_norm.weight")
            and name.replace(".q_norm.", ".k_norm.") not in names
        }
        if added:
            save_file({**tensors, **added}, folder / file, metadata={"format": "pt"})
            if index is not None:
                index["weight_map"].update(dict.fromkeys(added, file))
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2))
