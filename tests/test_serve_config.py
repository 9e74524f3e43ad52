"""The `kvcached serve` configuration: the YAML file in both shapes, the quick form, and
one error listing every problem, each naming the model, the field and what is accepted."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvcached.apps.serve import config as serve_config
from kvcached.apps.serve.config import (
    MAX_NAME_CHARS,
    ConfigError,
    ModelSpec,
    ServeConfig,
    default_budget,
    load_config,
    parse_model_option,
    quick_config,
    validate_config,
)
from kvcached.config import reload_settings

GiB = 1 << 30
MiB = 1 << 20


# the configs here name folders like /m/qwen that this machine has not got
pytestmark = pytest.mark.usefixtures("model_folders_exist")


def test_a_model_folder_that_does_not_exist_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.undo()
    there = tmp_path / "model"
    there.mkdir()
    assert quick_config([f"a={there}"], budget="1GiB").models[0].path == str(there)
    with pytest.raises(ConfigError) as caught:
        quick_config([f"a={tmp_path / 'gone'}", "b=org/repo:mlx"], budget="1GiB")
    assert caught.value.problems == [
        f'models[a].path: "{tmp_path / "gone"}": no such folder; accepted: a model folder, '
        "or an HF repo id for mlx"
    ]


def write(tmp_path: Path, text: str, name: str = "serve.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def problems_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate_config(data)
    return caught.value.problems


def one_model(**fields: Any) -> dict[str, Any]:
    """A config of one model `m` with `fields`, and a budget of 8 GiB."""
    return {"budget": "8GiB", "models": {"m": {"path": "/models/m", **fields}}}


# ------------------------------------------------------------------ shapes and defaults
def test_the_mapping_form_names_each_model_by_its_key(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        budget: 16GiB
        max_awake: 2
        models:
          qwen:
            path: /models/qwen
            limit: 50%
            min: 2GiB
            keep_alive: 10m
            priority: 3
          tiny: {path: mlx-community/tiny, engine: mlx, sleep: unload, preload: false}
          short: /models/short
        """,
    )
    config = load_config(path)
    assert config.names() == ["qwen", "tiny", "short"]
    qwen = config.model("qwen")
    assert (qwen.engine, qwen.path, qwen.limit, qwen.min) == (
        "vllm",
        "/models/qwen",
        8 * GiB,
        2 * GiB,
    )
    assert (qwen.keep_alive, qwen.priority, qwen.sleep, qwen.preload) == (600.0, 3, "kv", True)
    tiny = config.model("tiny")
    assert (tiny.engine, tiny.sleep, tiny.preload, tiny.limit) == ("mlx", "unload", False, None)
    assert config.model("short").path == "/models/short"
    assert (config.budget, config.max_awake) == (16 * GiB, 2)


def test_command_line_values_override_the_files(tmp_path: Path) -> None:
    path = write(tmp_path, "budget: 4GiB\nport: 8001\nmodels:\n  a: {path: /a}\n")
    config = load_config(path, port=9000, budget=None, max_awake=2)
    assert (config.port, config.budget, config.max_awake) == (9000, 4 * GiB, 2)
    with pytest.raises(ConfigError) as caught:
        load_config(path, port="x")
    assert caught.value.problems[0].startswith('port: "x" is not a port')


def test_the_list_form_reads_the_same_as_the_mapping_form(tmp_path: Path) -> None:
    mapping = load_config(
        write(
            tmp_path,
            "budget: 4GiB\nmodels:\n  a: {path: /a, min: 1GiB}\n  b: {path: /b}\n",
            "m.yaml",
        )
    )
    listed = load_config(
        write(
            tmp_path,
            "budget: 4GiB\nmodels:\n  - {name: a, path: /a, min: 1GiB}\n  - {name: b, path: /b}\n",
            "l.yaml",
        )
    )
    assert mapping == listed


def test_defaults_are_those_of_the_design(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCACHED_SERVE_API_KEY", raising=False)
    config = validate_config({"budget": 1 << 30, "models": [{"name": "m", "path": "/m"}]})
    spec = config.models[0]
    assert spec.model_dump() == {
        "name": "m",
        "engine": "vllm",
        "path": "/m",
        "args": [],
        "env": {},
        "limit": None,
        "start_room": None,
        "min": 0,
        "priority": 0,
        "keep_alive": 300.0,
        "sleep": "kv",
        "preload": True,
    }
    top = config.model_dump(exclude={"models"})
    assert top == {
        "budget": 1 << 30,
        "max_awake": None,
        "host": "127.0.0.1",
        "port": 8000,
        "api_key": None,
        "log_dir": Path("kvcached-serve-logs"),
        "ledger_dir": None,
        "max_queue": 64,
        "queue_timeout": 600.0,
        "start_timeout": 600.0,
        "engine_env": {},
    }


def test_sizes_are_kvcacheds_own_and_percentages_are_of_the_budget() -> None:
    config = validate_config(
        {
            "budget": "8GiB",
            "models": {
                "a": {"path": "/a", "limit": "25%", "min": "512MiB"},
                "b": {"path": "/b", "limit": "1.5GB", "min": 4096},
                "c": {"path": "/c", "limit": 3 * GiB, "min": "0"},
            },
        }
    )
    assert [(m.limit, m.min) for m in config.models] == [
        (2 * GiB, 512 * MiB),
        (1_500_000_000, 4096),
        (3 * GiB, 0),
    ]


def test_a_budget_percentage_is_of_the_devices_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_config, "device_memory", lambda: 10 * GiB)
    config = validate_config({"budget": "50%", "models": {"a": {"path": "/a", "limit": "50%"}}})
    assert (config.budget, config.models[0].limit) == (5 * GiB, 5 * GiB // 2)


@pytest.mark.parametrize(
    ("written", "seconds"),
    [
        (300, 300.0),
        (1.5, 1.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("500ms", 0.5),
        (0, 0.0),
        (-1, None),
        ("-1", None),
        ("never", None),
        (None, None),
    ],
)
def test_keep_alive_is_seconds_a_duration_or_never(written: object, seconds: float | None) -> None:
    config = validate_config(one_model(keep_alive=written))
    assert config.models[0].keep_alive == seconds


def test_timeouts_take_durations_but_never_never() -> None:
    config = validate_config({**one_model(), "queue_timeout": "2m", "start_timeout": 90})
    assert (config.queue_timeout, config.start_timeout) == (120.0, 90.0)
    lines = problems_of({**one_model(), "queue_timeout": "never", "start_timeout": 0})
    assert lines[0].startswith('queue_timeout: "never" is not accepted here; accepted: seconds')
    assert lines[1].startswith("start_timeout: 0 is not more than 0; accepted: seconds")


def test_args_pass_through_and_env_values_become_text() -> None:
    config = validate_config(
        one_model(args=["--max-model-len", 512, "--enforce-eager"], env={"CUDA_VISIBLE_DEVICES": 0})
    )
    spec = config.models[0]
    assert spec.args == ["--max-model-len", "512", "--enforce-eager"]
    assert spec.env == {"CUDA_VISIBLE_DEVICES": "0"}
    split = validate_config(one_model(args="--max-model-len 512 --served-model-name 'a b'"))
    assert split.models[0].args == ["--max-model-len", "512", "--served-model-name", "a b"]


def test_api_key_comes_from_the_environment_when_the_file_has_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVCACHED_SERVE_API_KEY", "sekret")
    reload_settings()
    assert validate_config(one_model()).api_key == "sekret"
    assert validate_config({**one_model(), "api_key": "own"}).api_key == "own"
    assert validate_config({**one_model(), "api_key": None}).api_key is None


def test_the_default_budget_asks_the_backend_and_only_when_none_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVCACHED_BACKEND", "host")
    monkeypatch.setenv("KVCACHED_HOST_BUDGET", "3GiB")
    monkeypatch.delenv("KVCACHED_BUDGET", raising=False)
    reload_settings()
    assert default_budget() == 3 * GiB
    assert quick_config(["m=/m"]).budget == 3 * GiB
    monkeypatch.setenv("KVCACHED_BUDGET", "1GiB")
    reload_settings()
    assert default_budget() == GiB

    def refuse() -> int:
        raise AssertionError("the device was asked although the budget is given")

    monkeypatch.setattr(serve_config, "default_budget", refuse)
    monkeypatch.setattr(serve_config, "device_memory", refuse)
    assert quick_config(["m=/m"], budget="2GiB").budget == 2 * GiB


# ----------------------------------------------------------------------- the quick form
@pytest.mark.parametrize(
    ("option", "fields"),
    [
        ("qwen=/models/qwen:vllm", {"name": "qwen", "path": "/models/qwen", "engine": "vllm"}),
        ("qwen=/models/qwen", {"name": "qwen", "path": "/models/qwen", "engine": "vllm"}),
        ("/models/qwen/:sglang", {"name": "qwen", "path": "/models/qwen/", "engine": "sglang"}),
        ("tiny=org/tiny-4bit:mlx", {"name": "tiny", "path": "org/tiny-4bit", "engine": "mlx"}),
        # a ':' that names no engine is part of the path
        ("x=/data/a:b", {"name": "x", "path": "/data/a:b", "engine": "vllm"}),
        ("/data/run=3/model", {"name": "model", "path": "/data/run=3/model", "engine": "vllm"}),
        ("./run=3", {"name": "run=3", "path": "./run=3", "engine": "vllm"}),
    ],
)
def test_quick_model_options(option: str, fields: dict[str, str]) -> None:
    assert parse_model_option(option) == fields


def test_quick_config_takes_top_level_overrides_as_a_file_would() -> None:
    config = quick_config(
        ["qwen=/path/to/model:vllm", "tiny=/p"],
        budget="8GiB",
        port=9001,
        max_awake=1,
        queue_timeout="1m",
        api_key=None,  # not given: the default
        model_defaults={"keep_alive": "5m"},
    )
    assert config.names() == ["qwen", "tiny"]
    assert (config.budget, config.port, config.max_awake, config.queue_timeout) == (
        8 * GiB,
        9001,
        1,
        60.0,
    )
    assert [m.keep_alive for m in config.models] == [300.0, 300.0]


def test_quick_config_reports_every_problem_at_once() -> None:
    with pytest.raises(ConfigError) as caught:
        quick_config(["a=/a", "a=/b", "bad name=/c"], budget="lots", port=70000)
    text = str(caught.value)
    assert "(the command line)" in text
    lines = caught.value.problems
    assert any(line.startswith('budget: "lots" is not a size; accepted:') for line in lines)
    assert any(
        line.startswith("port: 70000 is not a port; accepted: a port number") for line in lines
    )
    assert 'models[2].name: "bad name" is not a valid name; accepted:' in "\n".join(lines)
    assert "models[a].name: two models are named 'a'; accepted:" in "\n".join(lines)
    assert len(lines) == 4, lines


# ---------------------------------------------------------------- bad values, one by one
BAD_MODEL_VALUES = [
    ("name", "", 'models[0].name: "" is not a valid name; accepted: letters, digits'),
    ("name", "a b", 'models[0].name: "a b" is not a valid name; accepted: letters, digits'),
    ("name", "x" * (MAX_NAME_CHARS + 1), "is not a valid name; accepted: letters, digits"),
    ("name", 7, "models[0].name: 7 is not a name; accepted: letters, digits"),
    ("engine", "vlm", 'models[m].engine: "vlm" is not an engine; accepted: vllm, sglang, mlx'),
    ("path", "", 'models[m].path: "" is not a path; accepted: a model folder'),
    ("args", {"a": 1}, "models[m].args: {'a': 1} is not a list; accepted: a list of the engine"),
    ("args", [True], "models[m].args: True is not an argument; accepted: a list of the engine"),
    ("env", ["A"], "models[m].env: ['A'] is not a mapping; accepted: a mapping of environment"),
    ("env", {"A-B": "1"}, 'models[m].env: "A-B" is not a variable name'),
    ("env", {"A": True}, "models[m].env: A: True is not a string (quote it)"),
    ("env", {"KVCACHED_INSTANCE_NAME": "x"}, "KVCACHED_INSTANCE_NAME is set by kvcached serve"),
    ("limit", "lots", 'models[m].limit: "lots" is not a size; accepted: bytes or a size like 4GiB'),
    ("limit", 0, "models[m].limit: 0 is not a size (it must be more than 0); accepted: bytes"),
    ("limit", "150%", 'models[m].limit: "150%": a percentage must be in (0, 100]; accepted:'),
    ("limit", "64m", 'models[m].limit: "64m" is ambiguous: write 64MiB'),
    ("limit", 1.5, "models[m].limit: 1.5 is not a size; accepted: bytes"),
    (
        "min",
        "lots",
        'models[m].min: "lots" is not a size; accepted: bytes or a size like 4GiB, '
        "512MiB, or a percentage of the budget like 25%",
    ),
    ("min", -1, "models[m].min: -1 is not a size (it must be more than 0); accepted: bytes"),
    ("priority", "high", 'models[m].priority: "high" is not an integer; accepted: an integer'),
    ("priority", 1.5, "models[m].priority: 1.5 is not an integer; accepted: an integer"),
    ("keep_alive", "soon", 'models[m].keep_alive: "soon" is not a duration; accepted: seconds'),
    ("keep_alive", True, "models[m].keep_alive: True is not a duration; accepted: seconds"),
    ("sleep", "deep", 'models[m].sleep: "deep" is not a sleep mode; accepted: kv, weights, unload'),
    ("preload", "maybe", 'models[m].preload: "maybe" is not true or false; accepted: true'),
    ("limt", 1, "models[m].limt: unknown key; accepted: name, engine, path, args, env, limit"),
]


@pytest.mark.parametrize(("field", "value", "expected"), BAD_MODEL_VALUES)
def test_a_bad_model_value_names_the_model_the_field_and_what_is_accepted(
    field: str, value: object, expected: str
) -> None:
    if field == "name":
        data: dict[str, Any] = {"budget": "8GiB", "models": [{"name": value, "path": "/m"}]}
    else:
        data = one_model(**{field: value})
    lines = problems_of(data)
    assert len(lines) == 1, lines
    assert expected in lines[0], lines[0]


BAD_TOP_VALUES = [
    ("budget", "lots", 'budget: "lots" is not a size; accepted: bytes or a size like 16GiB'),
    ("budget", 0, "budget: 0 is not a size (it must be more than 0)"),
    ("max_awake", 0, "max_awake: 0 is not accepted; accepted: an integer >= 1, or null"),
    ("max_awake", "two", 'max_awake: "two" is not accepted; accepted: an integer >= 1'),
    ("host", "not a host!", 'host: "not a host!" is not an address; accepted: an IP address'),
    ("port", -1, "port: -1 is not a port; accepted: a port number, 1-65535"),
    ("port", "80", 'port: "80" is not a port; accepted: a port number'),
    ("api_key", "", 'api_key: "" is not a key; accepted: a non-empty string, or null'),
    ("log_dir", 3, "log_dir: 3 is not a folder; accepted: a folder path"),
    ("ledger_dir", "", 'ledger_dir: "" is not a folder; accepted: a folder path, or null'),
    ("max_queue", 0, "max_queue: 0 is not accepted; accepted: an integer >= 1"),
    ("queue_timeout", "soon", 'queue_timeout: "soon" is not a duration; accepted: seconds'),
    ("start_timeout", -5, "start_timeout: -5 is not a finite duration of 0 or more"),
    ("engine_env", {"ENABLE_KVCACHED": "0"}, "engine_env: ENABLE_KVCACHED is set by kvcached"),
    ("models", [], "models: no models are given; accepted: a mapping of model names"),
    ("models", "qwen", 'models: "qwen" is not a list or mapping of models; accepted:'),
    ("model", {}, "model: unknown key; accepted: models, budget, max_awake, host, port"),
]


@pytest.mark.parametrize(("field", "value", "expected"), BAD_TOP_VALUES)
def test_a_bad_top_level_value_names_the_field_and_what_is_accepted(
    field: str, value: object, expected: str
) -> None:
    lines = problems_of({**one_model(), field: value})
    assert len(lines) == 1, lines
    assert expected in lines[0], lines[0]


def test_a_missing_field_says_what_it_should_be() -> None:
    lines = problems_of({"budget": "1GiB", "models": {"m": {"engine": "vllm"}}})
    assert lines == ["models[m].path: missing; accepted: a model folder, or an HF repo id for mlx"]
    assert problems_of({"budget": "1GiB"})[0].startswith("models: missing; accepted:")


def test_a_model_entry_that_is_not_a_mapping_is_named_by_its_key() -> None:
    lines = problems_of({"budget": "1GiB", "models": {"m": [1, 2]}})
    assert lines[0].startswith("models[m]: [1, 2] is not a mapping of fields; accepted: name,")


def test_the_mapping_form_refuses_a_name_that_differs_from_its_key() -> None:
    lines = problems_of({"budget": "1GiB", "models": {"m": {"name": "n", "path": "/m"}}})
    assert lines == [
        'models[m].name: "n" differs from the key it is under ("m"); accepted: no name: in '
        "the mapping form (the key is the name), or the same name"
    ]
    # the same name is harmless
    assert validate_config({"budget": "1GiB", "models": {"m": {"name": "m", "path": "/m"}}})


# ------------------------------------------------------------------- checks across fields
def test_limit_below_min_is_refused() -> None:
    lines = problems_of(one_model(limit="1GiB", min="2GiB"))
    assert lines == [
        "models[m].limit: 1.00 GiB is below min (2.00 GiB); accepted: a limit at or above "
        "min, or null"
    ]
    assert validate_config(one_model(limit="2GiB", min="2GiB")).models[0].limit == 2 * GiB


def test_start_room_is_a_size_or_a_percentage_within_the_limit_and_the_budget() -> None:
    assert validate_config(one_model()).models[0].start_room is None  # estimated
    assert validate_config(one_model(start_room="300MiB")).models[0].start_room == 300 * MiB
    assert validate_config(one_model(start_room="25%")).models[0].start_room == 2 * GiB
    assert validate_config(one_model(limit="1GiB", start_room="1GiB")).models[0].limit == GiB
    assert problems_of(one_model(limit="1GiB", start_room="2GiB")) == [
        "models[m].start_room: 2.00 GiB is more than its limit (1.00 GiB); accepted: at most "
        "the limit, or null"
    ]
    assert problems_of(one_model(start_room="9GiB")) == [
        "models[m].start_room: 9.00 GiB is more than the budget (8.00 GiB); accepted: at most "
        "the budget; bytes or a size like 4GiB, 512MiB, or a percentage of the budget like "
        "25%, or null for kvcached serve's estimate"
    ]
    assert problems_of(one_model(start_room=0)) == [
        "models[m].start_room: 0 is not a size (it must be more than 0); accepted: bytes or a "
        "size like 4GiB, 512MiB, or a percentage of the budget like 25%, or null for "
        "kvcached serve's estimate"
    ]


def test_the_models_min_must_fit_in_the_budget() -> None:
    data = {
        "budget": "4GiB",
        "models": {"a": {"path": "/a", "min": "3GiB"}, "b": {"path": "/b", "min": "2GiB"}},
    }
    assert problems_of(data) == [
        "budget: the models' min add up to 5.00 GiB (a 3.00 GiB, b 2.00 GiB), more than the "
        "budget (4.00 GiB); accepted: a budget at least the sum of every model's min"
    ]
    data["budget"] = "5GiB"
    assert validate_config(data).budget == 5 * GiB


def test_a_limit_above_the_budget_is_refused() -> None:
    lines = problems_of(one_model(limit="9GiB"))
    assert lines[0].startswith("models[m].limit: 9.00 GiB is more than the budget (8.00 GiB)")


def test_two_models_of_one_name_are_refused() -> None:
    lines = problems_of(
        {"budget": "1GiB", "models": [{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}]}
    )
    assert lines == [
        "models[a].name: two models are named 'a'; accepted: a name of its own for each model"
    ]


def test_weights_sleep_is_refused_for_an_engine_that_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for engine in ("vllm", "sglang", "mlx"):  # the three engines can
        assert (
            validate_config(one_model(engine=engine, sleep="weights")).models[0].sleep == "weights"
        )
    monkeypatch.setitem(serve_config.SLEEP_MODES, "mlx", ("kv", "unload"))
    lines = problems_of(one_model(engine="mlx", sleep="weights"))
    assert lines == ["models[m].sleep: mlx cannot sleep with 'weights'; accepted: kv, unload"]


def test_every_problem_of_a_file_comes_in_one_error(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        budget: 8GiB
        max_awake: 0
        colour: blue
        models:
          qwen: {path: /m/qwen, min: lots, limit: 4GiB}
          big: {path: /m/big, min: 6GiB, limit: 2GiB}
          small: {path: /m/small, min: 3GiB, engine: vlm}
          a: {path: /m/a, keep_alive: soon}
        """,
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.source == str(path)
    assert caught.value.problems == [
        'models[qwen].min: "lots" is not a size; accepted: bytes or a size like 4GiB, 512MiB, '
        "or a percentage of the budget like 25%",
        "models[big].limit: 2.00 GiB is below min (6.00 GiB); accepted: a limit at or above "
        "min, or null",
        'models[small].engine: "vlm" is not an engine; accepted: vllm, sglang, mlx',
        'models[a].keep_alive: "soon" is not a duration; accepted: seconds, or a duration '
        'like "30s", "5m", "1h", or "never" (-1, null)',
        "max_awake: 0 is not accepted; accepted: an integer >= 1, or null for no cap",
        "colour: unknown key; accepted: models, budget, max_awake, host, port, api_key, "
        "log_dir, ledger_dir, max_queue, queue_timeout, start_timeout, engine_env",
        # the checks across models run over what could be read
        "budget: the models' min add up to 9.00 GiB (big 6.00 GiB, small 3.00 GiB), more than "
        "the budget (8.00 GiB); accepted: a budget at least the sum of every model's min",
    ]
    message = str(caught.value)
    assert message.startswith(f"invalid kvcached serve configuration ({path}), 7 problems:\n")
    assert message.count("\n") == 7  # one line each


# ---------------------------------------------------------------------------- the file
def test_a_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "nope.yaml")
    assert caught.value.problems == [
        f"{tmp_path / 'nope.yaml'} does not exist; accepted: a YAML file"
    ]
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path)


def test_a_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "budget: 8GiB\nmodels:\n  a: {path: /a\n  b: 1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    (line,) = caught.value.problems
    assert line.startswith("line 4, column 4: not valid YAML: "), line


def test_a_key_given_twice_is_refused_with_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "budget: 8GiB\nmodels:\n  a: {path: /a}\n  a: {path: /b}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == ['line 4, column 3: not valid YAML: the key "a" is given twice']


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "the file is empty; accepted: a mapping with models:"),
        ("- a\n- b\n", "the file holds list, not a mapping; accepted: a mapping with models:"),
    ],
)
def test_a_file_that_is_no_mapping_says_what_it_holds(
    tmp_path: Path, text: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text))
    assert caught.value.problems[0].startswith(expected)


def test_config_error_is_an_invalid_argument() -> None:
    from kvcached.errors import InvalidArgument

    error = ConfigError(["a: b"], "f.yaml")
    assert isinstance(error, InvalidArgument)
    assert str(error) == "invalid kvcached serve configuration (f.yaml), 1 problem:\n  a: b"


def test_direct_construction_checks_too() -> None:
    spec = ModelSpec(name="m", path="/m", limit="1GiB")
    assert spec.limit == GiB
    config = ServeConfig(models=[spec], budget="2GiB")
    assert config.model("m") is spec
    with pytest.raises(ValueError, match="is a percentage of the budget"):
        ModelSpec(name="m", path="/m", limit="25%")
    with pytest.raises(ValueError, match="no model is called 'x'; the models are: m"):
        config.model("x")
