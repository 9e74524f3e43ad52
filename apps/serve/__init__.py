"""`kvcached serve`: several models on one machine behind one OpenAI endpoint.

The application kvcached exists for. One supervisor process (this package, run by
`kvcached serve CONFIG.yaml` or `kvcached serve --model NAME=PATH[:engine]`) starts one
engine process per model: vLLM's OpenAI server, SGLang's server, or an MLX worker
(`kvcached serve-mlx` with one model), each with `ENABLE_KVCACHED=1`, a free port on
127.0.0.1, its ledger row named after the model and its log in a file of its own. All of
them share one device ledger, so one budget. In front, one router (Starlette under
uvicorn, httpx to the engines) routes on the request's `model`, streams server-sent
events through as they come, and holds the requests of a model that is asleep, loading
or waking until it can serve them (bounded queue, bounded wait, 503 with `Retry-After`
past either).

Modules, in the order a request meets them:

- `config`: the YAML file and the quick form, validated (pydantic) before anything starts.
- `router`: the HTTP surface (`/v1/models`, `/v1/completions`, `/v1/chat/completions`,
  `/health`, `/metrics`, `/dashboard`, `/api/state`).
- `state`: what the router, the supervisor, the policy and the dashboard share: a
  model's lifecycle state, its counters and the errors a request can meet.
- `supervisor`: one `EngineProcess` per model (start, health, sleep, wake, restart with
  back-off, stop leaving nothing behind) and the `launchers` that spell each engine's
  command line and sleep/wake calls.
- `policy`: who gets memory and who sleeps, as a pure function of the models' states
  and the ledger (decision record 0009); the supervisor carries its decisions out
  through the ledger's limits, the lever `kvctl limit` pulls.
- `dashboard`, `metrics`: the live page and the Prometheus series, from one snapshot.
"""
