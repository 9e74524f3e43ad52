"""Test machinery that ships: the random-weight model builders.

Nothing here is used to serve a model. These modules build small random-weight Hugging
Face checkpoints with a tokenizer trained on the spot, because no model can be
downloaded where kvcached is tested. The project's tests, benchmarks and compatibility
matrix use them, and so do two product commands: ``kvcached demo-vllm`` serves a tiny
model from `random_model`, and the matrix's rows come from `random_arch`. That is why
the package is in the wheel. It is named for what it is so that no one takes it for
part of the cache.

* `random_model`: Qwen3- and Llama-shaped checkpoints, written by hand.
* `random_arch`: one random checkpoint per row of the compatibility matrix, built from
  each architecture's own Transformers config.
"""
