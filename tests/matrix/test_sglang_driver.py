"""The matrix harness's SGLang driver, the parts that run without SGLang or a GPU.

The SGLang column itself runs on the H200 (scripts/matrix-sglang-gpu.sh). Here: the
Engine arguments against SGLang 0.5.16's own ServerArgs fields (where its source is
unpacked), each row's attention backend and batch, the run environment, how a failed
run is read (refusal, SGLang's wrapper errors, a hung run), the column's JSON across
split commands, and its rendering.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: process_state
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import harness
import render_compatibility
from process_state import ended

from kvcached.testing.random_arch import ARCHITECTURES

# loaded under its own name: tests/vllm_engine/generate.py is a "generate" module too
_spec = importlib.util.spec_from_file_location("sglang_generate", harness.SGLANG_GENERATE)
assert _spec is not None and _spec.loader is not None
sglang_generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sglang_generate)

#: SGLang 0.5.16's source, unpacked on developer machines that read it (not in CI)
SGLANG_SOURCE = Path("/tmp/sglang-0.5.16/sglang/srt/server_args.py")


def _options(row: str, *, kvcached: bool) -> dict[str, Any]:
    args = sglang_generate.parse(["/m", *harness.engine_batch("sglang", row, gpu=True)])
    return sglang_generate.engine_options(args, kvcached=kvcached)


def test_baseline_gets_the_benchmarks_static_pool_and_kvcached_does_not() -> None:
    alone = _options("standard-gqa", kvcached=False)
    served = _options("standard-gqa", kvcached=True)
    assert alone.pop("mem_fraction_static") == 0.3
    assert alone == served  # otherwise the two runs start SGLang alike
    assert served["enable_deterministic_inference"] is True
    assert served["dtype"] == "bfloat16" and served["context_length"] == 2048
    assert "attention_backend" not in served  # Qwen3: SGLang's own choice, as benchmarked


@pytest.mark.parametrize(
    ("row", "backend"),
    [
        ("sliding-window-hybrid", "fa3"),
        ("cross-layer-kv-sharing", "triton"),  # SGLang asserts triton/trtllm_mha for Gemma 4
        ("heterogeneous-kv-groups", "triton"),
        ("mla", "fa3"),  # deterministic DeepSeek takes fa3 or triton only
        ("hybrid-linear-attention", None),
    ],
)
def test_each_row_gets_the_attention_backend_sglang_accepts_for_it(
    row: str, backend: str | None
) -> None:
    assert _options(row, kvcached=True).get("attention_backend") == backend


@pytest.mark.skipif(not SGLANG_SOURCE.exists(), reason="SGLang 0.5.16's source is not here")
def test_every_engine_option_is_a_server_args_field_of_sglang_0_5_16() -> None:
    fields = set(re.findall(r"^    (\w+): ", SGLANG_SOURCE.read_text(), flags=re.M))
    for row in ARCHITECTURES:
        for kvcached in (False, True):
            unknown = set(_options(row, kvcached=kvcached)) - fields
            assert unknown == set(), (row, unknown)
    choices = SGLANG_SOURCE.read_text().split("DETERMINISTIC_ATTENTION_BACKEND_CHOICES = [")[1]
    for backend in harness.SGLANG_ATTENTION_BACKENDS.values():
        assert f'"{backend}"' in choices.split("]")[0]  # deterministic mode accepts it


def test_the_batch_passes_every_sliding_window_and_fits_the_context() -> None:
    args = sglang_generate.parse(["/m", *harness.engine_batch("sglang", "mla", gpu=True)])
    windows = [
        arch.config(scale="gpu").get("sliding_window") or 0 for arch in ARCHITECTURES.values()
    ]
    assert args.prompt_len > max(windows) == 1024
    assert args.repeat >= 2  # the second run reads the radix cache
    with pytest.raises(SystemExit):  # a batch past the context is refused up front
        sglang_generate.parse(["/m", "--prompt-len", "2000", "--max-tokens", "100"])


def test_prompts_repeat_and_stay_inside_the_matrix_tokenizer() -> None:
    first = sglang_generate.prompts(3, 50, seed=0)
    assert first == sglang_generate.prompts(3, 50, seed=0)
    assert first != sglang_generate.prompts(3, 50, seed=1)  # the warm-up batch differs
    assert all(10 <= t < 1000 for p in first for t in p) and len(first[0]) == 50


def test_sglang_runs_leave_the_backend_to_the_gpu_and_set_the_benchmarks_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVCACHED_BACKEND", raising=False)
    monkeypatch.delenv("KVCACHED_BUDGET", raising=False)
    env = harness.engine_env("sglang", tmp_path, kvcached=True, many_extents=False)
    assert env["ENABLE_KVCACHED"] == "1" and env["KVCACHED_BUDGET"] == "40GiB"
    assert "KVCACHED_BACKEND" not in env and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert "KVCACHED_EXTENT_SIZE" not in env
    vllm = harness.engine_env("vllm", tmp_path, kvcached=False, many_extents=True)
    assert vllm["KVCACHED_BACKEND"] == "host" and vllm["ENABLE_KVCACHED"] == "0"


#: what an SGLang engine process prints when its scheduler refused the model
REFUSED_OUTPUT = """\
[2026-12-01 10:00:00] Scheduler hit an exception: Traceback (most recent call last):
  File "sglang/srt/managers/scheduler.py", line 4530, in run_scheduler_process
kvcached.engines.sglang.refusals.Refused: kvcached: hybrid sliding-window models build \
two KV pools; the adapter serves models with one full-attention (MHA or MLA) pool. Unset \
ENABLE_KVCACHED to run without kvcached.
Traceback (most recent call last):
  File "tests/sglang_engine/generate.py", line 99, in main
RuntimeError: Initialization failed. Please see the error messages above.
"""


def test_a_refusal_in_the_scheduler_is_the_cells_detail_not_the_engines_wrapper() -> None:
    refusal = harness._refusal(REFUSED_OUTPUT)
    assert refusal is not None and refusal.startswith("kvcached: hybrid sliding-window")
    assert refusal.endswith("Unset ENABLE_KVCACHED to run without kvcached.")
    failed = {"ok": False, "refused": True, "error": refusal, "started": False}
    cell = harness.judge({"ok": True, "runs": [[[1]]]}, failed)
    assert cell == {"outcome": "refused", "detail": refusal}


def test_a_failure_names_the_schedulers_error_not_the_engines_wrapper() -> None:
    output = REFUSED_OUTPUT.replace(
        REFUSED_OUTPUT.splitlines()[2], "ValueError: Qwen3_5ForCausalLM has no SGlang model"
    )
    assert harness._refusal(output) is None
    assert harness._last_error(output) == "ValueError: Qwen3_5ForCausalLM has no SGlang model"
    died = "ValueError: bad\nRuntimeError: Rank 0 scheduler died during initialization (exit"
    assert harness._last_error(died) == "ValueError: bad"
    only = "RuntimeError: Initialization failed. Please see the error messages above.\nbye"
    assert harness._last_error(only) == "bye"  # no exception line: the last line


def test_an_equal_sglang_row_says_what_the_radix_cache_and_the_tokens_showed() -> None:
    runs = [[[5, 6], [7, 7]], [[5, 6], [7, 7]]]
    base = {"ok": True, "runs": runs, "cached_prompt_tokens": [0, 2300], "distinct_tokens": 40}
    cell = harness.judge(base, {**base})
    assert cell["outcome"] == "equal"
    assert "2 runs of 2 prompts equal" in cell["detail"]
    assert "[0, 2300]" in cell["detail"] and "40 distinct output tokens" in cell["detail"]
    other = harness.judge(base, {**base, "runs": [runs[0], [[5, 6], [7, 8]]]})
    assert other["outcome"] == "different_tokens"


def test_a_degenerate_model_is_not_run_whatever_its_tokens() -> None:
    # SGLang's standalone Llama4ForCausalLM left the experts unloaded on the H200: every
    # prompt gave one token, "equal" with or without kvcached, proving nothing
    runs = [[[7, 7], [7, 7]]]
    base = {"ok": True, "runs": runs, "distinct_tokens": 1}
    for other in (runs, [[[7, 8], [7, 7]]]):  # equal or not, the run cannot decide
        cell = harness.judge(base, {**base, "runs": other})
        assert cell["outcome"] == "not_run" and "1 distinct output tokens" in cell["detail"]
    enough = {**base, "distinct_tokens": harness.MIN_DISTINCT_TOKENS}
    assert harness.judge(enough, enough)["outcome"] == "equal"


def test_a_hung_run_is_killed_with_its_children_and_reads_as_a_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time;"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True);"
        "time.sleep(60)"
    )
    began = time.monotonic()
    code, stdout, stderr = harness._run([sys.executable, "-c", script], {}, timeout=3)
    assert time.monotonic() - began < 20
    assert code != 0 and "started" in stdout
    assert harness._last_error(stdout + stderr) == "TimeoutError: no result in 3 s"
    child = int(pid_file.read_text())
    for _ in range(50):  # the killed child is reaped by init shortly after
        if ended(child):
            break
        time.sleep(0.1)
    assert ended(child)


def test_a_run_cut_by_the_rows_time_says_out_of_time_and_other_errors_stay() -> None:
    # the H200 run of 2026-12-04 (Qwen3-Next): the row's time ran out in a run
    cut = harness._killed_or_failed("TimeoutError: no result in 60 s", 460.0)
    assert cut.startswith("out of time: the row's 460 s ran out") and "60 s" in cut
    crash = "RuntimeError: Prefill out of memory"
    assert harness._killed_or_failed(crash, 460.0) == crash


def _fake_row(name: str, work: Path, **kwargs: Any) -> dict[str, Any]:
    # stands in for a device run: the merge logic, not SGLang, is under test here
    assert kwargs["engine"] == "sglang" and kwargs["gpu"] is True
    return {"architecture": name, "outcome": "equal", "detail": "now", "throughput_ratio": 1.0}


def _runs_then_corrupted(
    runs: list[list[list[int]]], *, kvcached: bool, **fields: Any
) -> dict[str, Any]:
    """What tests/sglang_engine/generate.py reports for a row: the clean runs and, on
    the kvcached side, the corrupted run that changed the second prompt's tokens."""
    result = {"ok": True, "runs": runs, "cached_prompt_tokens": [0, 2300],
              "distinct_tokens": 40, "tokens_per_s": 100.0, "seconds": 100.0, **fields}  # fmt: skip
    if kvcached:
        result |= {"corrupted_run": [[5, 6], [9, 9]], "corrupted_blocks": 40,
                   "corrupted_at_step": 0, "corrupted_after_tokens": 0}  # fmt: skip
    return result


def test_one_kvcached_run_gives_both_the_equality_and_its_corrupted_counterpart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # on the H200 an engine start costs a minute of device time: the corrupted run is
    # one more batch in the kvcached engine, not a third start
    from kvcached.testing import random_arch

    runs = [[[5, 6], [7, 7]], [[5, 6], [7, 8]]]
    started: list[tuple[str, ...]] = []

    def fake_run(model: Path, ledger: Path, **kwargs: Any) -> dict[str, Any]:
        started.append(tuple(kwargs["batch"]))
        return _runs_then_corrupted(runs, kvcached=kwargs["kvcached"])

    monkeypatch.setattr(random_arch, "make_arch_model", lambda folder, *a, **k: folder)
    monkeypatch.setattr(harness, "run_engine", fake_run)
    row = harness.run_row("mla", tmp_path, gpu=True, engine="sglang", timeout=500.0)
    assert row["outcome"] == "equal"
    assert [("--corrupt" in batch) for batch in started] == [False, True]
    assert row["corruption"] == {
        "swapped_blocks": 40, "at_step": 0, "equal_before": True, "changed_tokens": True
    }  # fmt: skip
    harness.assert_corruption_proves_failure(row["corruption"])


def test_a_corruption_that_could_not_be_made_leaves_the_equality_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcached.testing import random_arch

    def fake_run(model: Path, ledger: Path, **kwargs: Any) -> dict[str, Any]:
        result = {"ok": True, "runs": [[[1, 2]]], "tokens_per_s": 10.0, "seconds": 1.0}
        if kwargs["kvcached"]:
            result["corruption_error"] = "TimeoutError: the corrupting plugin did not run"
        return result

    monkeypatch.setattr(random_arch, "make_arch_model", lambda folder, *a, **k: folder)
    monkeypatch.setattr(harness, "run_engine", fake_run)
    row = harness.run_row("mla", tmp_path, gpu=True, engine="sglang", timeout=500.0)
    assert row["outcome"] == "equal"
    assert row["corruption"] == {"error": "TimeoutError: the corrupting plugin did not run"}
    with pytest.raises(AssertionError, match="the corruption run failed"):
        harness.assert_corruption_proves_failure(row["corruption"])


def test_a_kvcached_run_the_rows_time_cut_says_out_of_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcached.testing import random_arch

    def fake_run(model: Path, ledger: Path, **kwargs: Any) -> dict[str, Any]:
        if kwargs["kvcached"]:
            return {"ok": False, "error": "TimeoutError: no result in 60 s", "refused": False,
                    "started": True, "seconds": 60.0}  # fmt: skip
        return {"ok": True, "runs": [[[1, 2]]], "tokens_per_s": 10.0, "seconds": 1.0}

    monkeypatch.setattr(random_arch, "make_arch_model", lambda folder, *a, **k: folder)
    monkeypatch.setattr(harness, "run_engine", fake_run)
    row = harness.run_row("mla", tmp_path, gpu=True, engine="sglang", timeout=460.0)
    assert row["detail"].startswith("out of time: the row's 460 s ran out during this run")
    assert "corruption" not in row


def test_a_split_column_carries_the_earlier_commands_rows_in_row_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(harness, "run_row", _fake_row)
    monkeypatch.setattr(harness, "engine_label", lambda gpu, engine: "SGLang 0.5.16 (H200)")
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    common = ["--engine", "sglang", "--gpu"]
    assert harness.main([*common, "--out", str(first), "mla", "standard-gqa"]) == 0
    again = [*common, "--keep", str(first), "--out", str(second), "cross-layer-kv-sharing"]
    assert harness.main(again) == 0
    table = json.loads(second.read_text())
    assert table["engine"] == "sglang-gpu"
    assert table["command"].startswith("python tests/matrix/harness.py --engine sglang --gpu")
    names = [row["architecture"] for row in table["rows"]]
    assert names == ["standard-gqa", "cross-layer-kv-sharing", "mla"]  # ARCHITECTURES order
    with pytest.raises(ValueError, match="holds the 'sglang-gpu' column, not 'vllm-gpu'"):
        harness.kept_rows(second, "vllm-gpu")


def test_a_row_cut_by_the_deadline_keeps_its_earlier_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(harness, "engine_label", lambda gpu, engine: "SGLang 0.5.16 (H200)")
    monkeypatch.setattr(harness, "run_row", _fake_row)
    earlier = tmp_path / "earlier.json"
    assert harness.main(["--engine", "sglang", "--gpu", "--out", str(earlier), "mla"]) == 0

    def slow_row(name: str, work: Path, **kwargs: Any) -> dict[str, Any]:
        time.sleep(0.3)
        return _fake_row(name, work, **kwargs)

    monkeypatch.setattr(harness, "run_row", slow_row)
    out = tmp_path / "out.json"
    argv = ["--engine", "sglang", "--gpu", "--deadline", "0.4", "--keep", str(earlier)]
    rows_now = ["standard-gqa", "sliding-window-hybrid", "mla"]
    assert harness.main([*argv, "--out", str(out), *rows_now]) == 0
    rows = {row["architecture"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["standard-gqa"]["outcome"] == "equal"
    assert rows["sliding-window-hybrid"]["outcome"] == "not_run"  # cut, nothing earlier
    assert rows["sliding-window-hybrid"]["detail"].startswith("out of time")
    assert rows["mla"] == _fake_row("mla", tmp_path, engine="sglang", gpu=True)  # kept


def test_sglang_without_the_gpu_is_an_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        harness.main(["--engine", "sglang", "--out", "/tmp/never.json"])
    assert "--engine sglang needs --gpu" in capsys.readouterr().err


def test_a_kv_cache_dtype_reaches_both_runs_of_a_vllm_row_and_is_vllms_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcached.testing import random_arch

    batches: list[tuple[str, ...]] = []

    def fake_run(model: Path, ledger: Path, **kwargs: Any) -> dict[str, Any]:
        batches.append(kwargs["batch"])
        corrupted = {"corrupted_run": [[1, 3]], "corrupted_blocks": 4, "corrupted_at_step": 2,
                     "corrupted_after_tokens": 1}  # fmt: skip
        return {"ok": True, "runs": [[[1, 2]]], "tokens_per_s": 10.0, "seconds": 1.0,
                **(corrupted if kwargs["kvcached"] else {})}  # fmt: skip

    monkeypatch.setattr(random_arch, "make_arch_model", lambda folder, *a, **k: folder)
    monkeypatch.setattr(harness, "run_engine", fake_run)
    out = tmp_path / "fp8.json"
    assert harness.main(["--kv-cache-dtype", "fp8", "--out", str(out), "standard-gqa"]) == 0
    assert len(batches) == 2  # vLLM alone, then kvcached (with its corrupted run)
    assert batches[0][-2:] == ("--kv-cache-dtype", "fp8")  # vLLM alone
    assert batches[1][-3:] == ("--kv-cache-dtype", "fp8", "--corrupt")  # and kvcached
    assert json.loads(out.read_text())["kv_cache_dtype"] == "fp8"
    with pytest.raises(SystemExit):
        harness.main(["--engine", "sglang", "--gpu", "--kv-cache-dtype", "fp8", "--out", str(out)])
    assert "--kv-cache-dtype is vLLM's" in capsys.readouterr().err


def test_the_sglang_column_renders_after_the_vllm_columns_with_its_ratio(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    cpu = {"engine": "vllm-cpu", "label": "vLLM-CPU 0.32.0", "rows": []}
    sglang = {
        "engine": "sglang-gpu",
        "label": "SGLang 0.5.16 (H200)",
        "rows": [
            {"architecture": "mla", "outcome": "equal", "detail": "x", "throughput_ratio": 0.912},
            {
                "architecture": "sliding-window-hybrid",
                "outcome": "refused",
                "detail": "kvcached: no",
            },
        ],
    }
    (results / "vllm-cpu.json").write_text(json.dumps(cpu))
    (results / "sglang-gpu.json").write_text(json.dumps(sglang))
    page = render_compatibility.render(render_compatibility.load(results))
    head = next(line for line in page.splitlines() if line.startswith("| architecture"))
    assert head.endswith("| vLLM-CPU 0.32.0 | SGLang 0.5.16 (H200) |")
    mla = next(line for line in page.splitlines() if line.startswith("| `mla`"))
    swa = next(line for line in page.splitlines() if line.startswith("| `sliding-window"))
    notes = dict(
        reversed(line.split(". ", 1))
        for line in page.splitlines()
        if line[:1].isdigit() and ". " in line
    )
    cpu_missing = notes[
        "not yet run on vLLM-CPU 0.32.0: the row is newer than this column's last run"
    ]
    assert mla.endswith(
        f"| ⏳ not run [{cpu_missing}] | ✅ equal, 0.91x throughput |"
    )  # no CPU row
    assert swa.endswith(f"| ➖ refused [{notes['kvcached: no']}] |")  # noqa: RUF001
    # a row a column lacks names that column, so each column's gap is a note of its own
    assert (
        "not yet run on SGLang 0.5.16 (H200): the row is newer than this column's last run" in notes
    )


@pytest.mark.parametrize(
    ("row", "full", "sliding"),
    [
        ("cross-layer-kv-sharing", (512, 1), (256, 1)),  # Gemma 4 E2B's widths
        ("heterogeneous-kv-groups", (512, 4), (256, 8)),  # fewer, wider global KV heads
    ],
)
def test_a_text_only_gemma4_gets_sglang_its_full_attention_widths(
    tmp_path: Path, row: str, full: tuple[int, int], sliding: tuple[int, int]
) -> None:
    from kvcached.testing.random_arch import ARCHITECTURES

    config = {"model_type": "gemma4_text", **ARCHITECTURES[row].config(scale="gpu")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = sglang_generate.parse([str(tmp_path)])
    overrides = json.loads(
        sglang_generate.engine_options(args, kvcached=True)["json_model_override_args"]
    )
    assert (overrides["head_dim"], overrides["num_key_value_heads"]) == full
    assert (overrides["swa_head_dim"], overrides["swa_num_key_value_heads"]) == sliding
    assert overrides["v_head_dim"] == full[0] and overrides["swa_v_head_dim"] == sliding[0]


def test_a_text_only_llama4_is_served_as_sglangs_llama4_class(tmp_path: Path) -> None:
    from kvcached.testing.random_arch import ARCHITECTURES

    config = ARCHITECTURES["chunked-local-attention"].config(scale="gpu")
    assert config["architectures"] == ["Llama4ForCausalLM"]  # what vLLM serves
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = sglang_generate.parse([str(tmp_path), *harness.engine_batch(
        "sglang", "chunked-local-attention", gpu=True)])  # fmt: skip
    options = sglang_generate.engine_options(args, kvcached=True)
    assert json.loads(options["json_model_override_args"]) == {
        "architectures": ["Llama4ForConditionalGeneration"]
    }
    assert options["attention_backend"] == "fa3"  # one of the five SGLang accepts for it
    assert sglang_generate.served_class(config) == "Llama4ForConditionalGeneration"
    assert sglang_generate.served_class({"architectures": ["Qwen3ForCausalLM"]}) == (
        "Qwen3ForCausalLM"
    )
    assert sglang_generate.served_class({}) is None


def test_the_row_names_the_class_sglang_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcached.testing import random_arch

    def fake_run(model: Path, ledger: Path, **kwargs: Any) -> dict[str, Any]:
        return {"ok": True, "runs": [[[5, 6]]], "distinct_tokens": 40, "tokens_per_s": 1.0,
                "served_class": "Llama4ForConditionalGeneration", "seconds": 1.0,
                "corruption_error": "not made here"}  # fmt: skip

    monkeypatch.setattr(random_arch, "make_arch_model", lambda folder, *a, **k: folder)
    monkeypatch.setattr(harness, "run_engine", fake_run)
    row = harness.run_row("chunked-local-attention", tmp_path, gpu=True, engine="sglang")
    assert row["class"] == "Llama4ForConditionalGeneration"


def test_other_models_get_no_overrides(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    options = sglang_generate.engine_options(sglang_generate.parse([str(tmp_path)]), kvcached=False)
    assert "json_model_override_args" not in options


def test_a_composite_checkpoint_runs_its_text_model_without_a_processor(tmp_path: Path) -> None:
    # Qwen3.5's published class carries a vision tower; SGLang would load its image
    # processor (the random checkpoint has none) unless multimodal is off
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"depth": 1}}))
    args = sglang_generate.parse([str(tmp_path), "--prompts", "2"])
    assert sglang_generate.engine_options(args, kvcached=True)["enable_multimodal"] is False
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert "enable_multimodal" not in sglang_generate.engine_options(args, kvcached=True)


def test_the_sglang_corruption_verdict_compares_the_radix_cache_runs() -> None:
    args = sglang_generate.parse(["/m", *harness.engine_batch("sglang", "mla", gpu=True)])
    assert args.repeat == 2  # the corrupted run reads the radix cache, as the second does
    clean = [[[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 7]]]
    caught = {
        "runs": clean,
        "corrupted_run": [[1, 2, 9], [4, 5, 7]],
        "corrupted_blocks": 40,
        "corrupted_at_step": 0,
        "corrupted_after_tokens": 0,
    }
    verdict = harness.corruption_verdict(caught, clean)
    assert verdict["equal_before"] and verdict["changed_tokens"]
    harness.assert_corruption_proves_failure(verdict)
    # a kvcached run that already differed before the corruption proves nothing
    differed = {**caught, "runs": [clean[0], [[1, 2, 4], [4, 5, 7]]]}
    with pytest.raises(AssertionError, match="differed before"):
        harness.assert_corruption_proves_failure(harness.corruption_verdict(differed, clean))
    # and corrupted pages that change no token fail the check: the reference is the
    # engine alone's last (radix-cache) run, not its first
    unchanged = {**caught, "corrupted_run": clean[1]}
    with pytest.raises(AssertionError, match="changed no token"):
        harness.assert_corruption_proves_failure(harness.corruption_verdict(unchanged, clean))


def test_the_vllm_corruption_verdict_compares_the_tokens_before_and_after_the_swap() -> None:
    clean = [[[1, 2, 3, 4], [5, 6, 7, 8]]]
    swapped = {
        "runs": clean,
        "corrupted_run": [[1, 2, 3, 0], [5, 6, 7, 8]],
        "corrupted_blocks": 6,
        "corrupted_at_step": 3,
        "corrupted_after_tokens": 2,
    }
    harness.assert_corruption_proves_failure(harness.corruption_verdict(swapped, clean))
    early = {**swapped, "corrupted_run": [[1, 0, 3, 4], [5, 6, 7, 8]]}
    with pytest.raises(AssertionError, match="differed before"):
        harness.assert_corruption_proves_failure(harness.corruption_verdict(early, clean))


def test_the_corrupting_run_needs_kvcached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENABLE_KVCACHED", "0")
    with pytest.raises(SystemExit, match="ENABLE_KVCACHED=1"):
        sglang_generate.main(["/m", "--prompts", "1", "--corrupt"])


def test_sliding_window_hybrids_run_in_sglangs_own_two_pools_with_and_without_kvcached() -> None:
    # kvcached serves SGLang's SWAKVPool pair (engines/sglang/swa.py): the rows compare
    # the same layout, not one pool against two
    for row in ("sliding-window-hybrid", "cross-layer-kv-sharing", "heterogeneous-kv-groups"):
        for kvcached in (False, True):
            assert "disable_hybrid_swa_memory" not in _options(row, kvcached=kvcached)


def test_only_rows_importing_torchvision_get_the_standin_and_only_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # as in CI
    assert harness.standins("hybrid-linear-attention", gpu=False) == (harness.STANDINS,)
    assert harness.standins("hybrid-linear-attention", gpu=True) == ()  # the GPU site has one
    assert harness.standins("standard-gqa", gpu=False) == ()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # a real one
    assert harness.standins("hybrid-linear-attention", gpu=False) == ()
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = harness.engine_env(
        "vllm", tmp_path, kvcached=False, many_extents=False, path=(harness.STANDINS,)
    )
    assert env["PYTHONPATH"].split(":") == [str(harness.STANDINS), "/elsewhere"]


def test_the_torchvision_standin_imports_and_fails_loudly_when_used() -> None:
    import subprocess

    # the names the vLLM and SGLang chains import, then two uses: each raises
    code = (
        "from torchvision.transforms.v2 import functional as tvF\n"
        "from torchvision.transforms import InterpolationMode\n"
        "from torchvision.io import decode_image\n"
        "import torchvision; print(torchvision.__version__)\n"
        "for use in (lambda: tvF.resize(None, [2, 2]), lambda: decode_image(b'')):\n"
        "    try:\n        use()\n"
        "    except (AttributeError, NotImplementedError) as exc:\n"
        "        print(type(exc).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(harness.STANDINS), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["0.26.0", "AttributeError", "NotImplementedError"]


def test_a_rows_note_is_a_footnote_beside_its_cell_whatever_the_outcome(tmp_path: Path) -> None:
    caught = {"swapped_blocks": 20, "at_step": 9, "equal_before": True, "changed_tokens": True}
    note = "ran with tests/standins/'s torchvision"
    rows = [
        {"architecture": "hybrid-linear-attention", "outcome": "equal", "detail": "x",
         "corruption": caught, "note": note},
        {"architecture": "mla", "outcome": "equal", "detail": "x", "corruption": caught},
    ]  # fmt: skip
    results = tmp_path / "results"
    results.mkdir()
    table = {"engine": "vllm-cpu", "label": "vLLM-CPU 0.32.0", "rows": rows}
    (results / "vllm-cpu.json").write_text(json.dumps(table))
    page = render_compatibility.render(render_compatibility.load(results))
    qwen35 = next(
        line for line in page.splitlines() if line.startswith("| `hybrid-linear-attention`")
    )
    mla = next(line for line in page.splitlines() if line.startswith("| `mla`"))
    numbered = [line for line in page.splitlines() if line.endswith(f". {note}")]
    assert len(numbered) == 1
    assert qwen35.endswith(f"| ✅ equal, corruption caught [{numbered[0].split('.')[0]}] |")
    assert mla.endswith("| ✅ equal, corruption caught |")


def test_the_throughput_ratio_is_the_last_runs_when_both_sides_ran_the_batch_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the engine alone runs first and compiles kernels in its first run; the ratio of
    # the whole runs made the H100's `mla` row 13.9x, the last runs' leaves that out
    from kvcached.testing import random_arch

    runs = [[[5, 6], [7, 7]], [[5, 6], [7, 7]]]

    def fake_run(model: Path, ledger: Path, **kwargs: Any) -> dict[str, Any]:
        first, last = (90.0, 99.0) if kwargs["kvcached"] else (10.0, 100.0)
        return _runs_then_corrupted(
            runs, kvcached=kwargs["kvcached"], tokens_per_s=(first + last) / 2,
            run_tokens_per_s=[first, last],
        )  # fmt: skip

    monkeypatch.setattr(random_arch, "make_arch_model", lambda folder, *a, **k: folder)
    monkeypatch.setattr(harness, "run_engine", fake_run)
    row = harness.run_row("mla", tmp_path, gpu=True, engine="sglang", timeout=500.0)
    assert row["outcome"] == "equal"
    assert row["throughput_ratio"] == 0.99 and row["throughput_of"] == "last run"
    # one run a side (vLLM's rows): the whole run's figure, as before
    assert harness.throughput({"tokens_per_s": 50.0}, {"tokens_per_s": 60.0}) == {
        "throughput_ratio": 1.2
    }
