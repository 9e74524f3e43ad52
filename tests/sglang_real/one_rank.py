"""SGLang's parallel state for one process of one rank, as a scheduler process has it
(its pools and the adapter ask for the tensor-parallel groups). Imported first by the
programs beside it."""

import os

from sglang.srt.distributed.parallel_state import (
    init_distributed_environment,
    initialize_model_parallel,
)

port = os.environ.get("KVCACHED_TEST_PORT", "29533")
init_distributed_environment(
    world_size=1,
    rank=0,
    local_rank=0,
    backend="gloo",
    distributed_init_method=f"tcp://127.0.0.1:{port}",
)
initialize_model_parallel(tensor_model_parallel_size=1, backend="gloo")
