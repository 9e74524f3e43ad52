"""Settings and sizes: every bad value gets an error naming it and what is accepted."""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest

from kvcached.allocator import PageAllocator
from kvcached.backends.host import HostBackend
from kvcached.cache import KVCache
from kvcached.config import parse_size, settings
from kvcached.errors import InvalidArgument
from kvcached.layout import KVLayout, LayerSpec

GiB = 1 << 30


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 * GiB), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096),
     (" 2 MiB ", 2 << 20), (123, 123)],
)  # fmt: skip
def test_sizes_parse(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


def test_percentages_need_a_total() -> None:
    assert parse_size("25%", total=8 * GiB) == 2 * GiB
    with pytest.raises(InvalidArgument, match="percentage is not accepted"):
        parse_size("25%")
    with pytest.raises(InvalidArgument, match=r"\(0, 100\]"):
        parse_size("150%", total=GiB)


@pytest.mark.parametrize(
    "bad", ["lots", "-1GiB", "0", "", "GiB", True, -5, "1.5.5GiB", "1.9", "2 MiB MiB"]
)
def test_bad_sizes_are_named(bad: str | int) -> None:
    with pytest.raises(InvalidArgument, match=r"size|positive"):
        parse_size(bad, what="test size")


def test_bad_env_values_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_DEVICE", "first")
    with pytest.raises(InvalidArgument, match="KVCACHED_DEVICE"):
        settings()


def test_negative_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_DEVICE", "-1")
    with pytest.raises(InvalidArgument, match="KVCACHED_DEVICE"):
        settings()


def test_host_budget_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_HOST_BUDGET", "64MiB")
    with HostBackend() as backend:
        assert backend.mem_info() == (64 << 20, 64 << 20)


def test_bad_host_budget_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_HOST_BUDGET", "a lot")
    with pytest.raises(InvalidArgument, match="KVCACHED_HOST_BUDGET 'a lot' is not a size"):
        HostBackend()


@pytest.mark.parametrize("bad", ["3MiB", "1000", "1KiB"])
def test_bad_host_granularity_is_refused(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("KVCACHED_HOST_GRANULARITY", bad)
    with pytest.raises(InvalidArgument, match="granularity"):
        HostBackend()


# ------------------------------------------------ every bad value named (issue 8.12)
@pytest.mark.parametrize(
    ("variable", "value", "accepted"),
    [
        ("KVCACHED_HOST_GRANULARITY", "lots", "a byte count"),
        ("KVCACHED_BUDGET", "lots", "percentage"),
        ("KVCACHED_BUDGET", "150%", r"\(0, 100\]"),
        ("KVCACHED_HOST_BUDGET", "-3GiB", "a byte count"),
        ("KVCACHED_EXTENT_SIZE", "0", "positive"),
        ("KVCACHED_EXTENT_SIZE", "1", "between 4096 bytes and 1 TiB"),
        ("KVCACHED_EXTENT_SIZE", "1EiB", "between 4096 bytes and 1 TiB"),
        ("KVCACHED_POOL_LOW", "some", "a byte count"),
        ("KVCACHED_POOL_RELEASE_DELAY", "inf", "finite"),
        ("KVCACHED_POOL_RELEASE_DELAY", "nan", "finite"),
        ("KVCACHED_POOL_RELEASE_DELAY", "1e9", "less than or equal to 86400"),
        ("KVCACHED_DEVICE", "100000", "less than or equal to 1023"),
        ("KVCACHED_LEDGER_DIR", "", "blank; accepted: an absolute path"),
        ("KVCACHED_LEDGER_DIR", "   ", "blank; accepted: an absolute path"),
        ("KVCACHED_METRICS_ADDR", "not an address", "accepted: an IP address"),
        ("KVCACHED_METRICS_ADDR", "127.0.0.1:9400", "accepted: an IP address"),
        ("KVCACHED_METRICS_ADDR", "http://localhost", "accepted: an IP address"),
        ("KVCACHED_METRICS_PORT", "0", "greater than or equal to 1"),
    ],
)
def test_bad_setting_names_its_variable_and_what_it_accepts(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, accepted: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(InvalidArgument) as caught:
        settings()
    assert variable in str(caught.value)
    assert re.search(accepted, str(caught.value)), str(caught.value)


@pytest.mark.parametrize("good", ["127.0.0.1", "0.0.0.0", "::1", "localhost", "metrics.internal"])
def test_metrics_addresses_that_are_addresses_are_accepted(
    monkeypatch: pytest.MonkeyPatch, good: str
) -> None:
    monkeypatch.setenv("KVCACHED_METRICS_ADDR", good)
    assert settings().metrics_addr == good


def test_pool_low_above_high_names_both_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_POOL_LOW", "3GiB")
    with pytest.raises(InvalidArgument, match=r"KVCACHED_POOL_HIGH .* KVCACHED_POOL_LOW"):
        settings()


def test_pool_low_above_high_names_the_arguments_given() -> None:
    with HostBackend(budget="64MiB") as backend:
        layout = KVLayout(backend, [LayerSpec(2, 64)], block_size=16, max_tokens=4096)
        with pytest.raises(InvalidArgument, match=r"pool_high \(2097152 bytes\) is below pool_low"):
            PageAllocator(layout.groups[0], pool_low=4 << 20, pool_high=2 << 20, background=False)
        with pytest.raises(InvalidArgument, match=r"KVCACHED_POOL_HIGH .* pool_low"):
            PageAllocator(layout.groups[0], pool_low=4 << 30, background=False)
        layout.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"extent_bytes": 0}, "extent_bytes 0 bytes is not accepted"),
        ({"extent_bytes": 1}, "extent_bytes 1 bytes is not accepted"),
        ({"extent_bytes": 1 << 60}, "between 4096 bytes and 1 TiB"),
        ({"release_delay": math.inf}, "release_delay must be a finite number"),
        ({"release_delay": math.nan}, "release_delay must be a finite number"),
    ],
)
def test_allocator_refuses_absurd_extents_and_delays(
    options: dict[str, float], message: str
) -> None:
    with HostBackend(budget="64MiB") as backend:
        layout = KVLayout(backend, [LayerSpec(2, 64)], block_size=16, max_tokens=4096)
        with pytest.raises(InvalidArgument, match=message):
            PageAllocator(layout.groups[0], background=False, **options)  # type: ignore[arg-type]
        layout.close()


def test_host_granularity_error_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_HOST_GRANULARITY", "3MiB")
    with pytest.raises(InvalidArgument, match=r"KVCACHED_HOST_GRANULARITY .* power of two"):
        HostBackend()


def test_budget_error_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    with (
        HostBackend(budget="64MiB") as backend,
        pytest.raises(InvalidArgument, match=r"^budget 'lots' is not a size"),
    ):
        KVCache([LayerSpec(2, 64)], block_size=16, name="x", backend=backend, budget="lots")


@pytest.mark.parametrize(("text", "mib", "mb"), [("64m", "64MiB", "64MB"), ("2g", "2GiB", "2GB")])
def test_one_letter_units_are_refused_as_ambiguous(text: str, mib: str, mb: str) -> None:
    """'64m' silently meant 64,000,000 bytes; users of docker or java mean 64 MiB."""
    with pytest.raises(InvalidArgument, match=rf"ambiguous: write {mib} .* or {mb}"):
        parse_size(text, what="KVCACHED_BUDGET")


def test_kvcached_info_validates_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvcached info` reported a healthy setup while KVCACHED_EXTENT_SIZE was 0."""
    from typer.testing import CliRunner

    from kvcached.apps.cli import app

    monkeypatch.setenv("KVCACHED_EXTENT_SIZE", "0")
    result = CliRunner().invoke(app, ["info", "--backend", "host", "--json"])
    assert result.exit_code == 1
    assert "KVCACHED_EXTENT_SIZE" in json.loads(result.output)["error"]


def test_kvcached_info_reports_a_setting_only_the_backend_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from typer.testing import CliRunner

    from kvcached.apps.cli import app

    monkeypatch.setenv("KVCACHED_HOST_GRANULARITY", "3MiB")
    result = CliRunner().invoke(app, ["info", "--backend", "host"])
    assert result.exit_code == 1
    assert "KVCACHED_HOST_GRANULARITY" in result.output


# ------------------------------------------------------------ one place reads them
@pytest.mark.parametrize(
    ("value", "on"),
    [
        ("1", True),
        ("true", True),
        (" Yes ", True),
        ("ON", True),
        ("0", False),
        ("", False),
        ("no", False),
        ("enabled", False),
    ],
)
def test_enable_kvcached_turns_the_engine_plugins_on(
    monkeypatch: pytest.MonkeyPatch, value: str, on: bool
) -> None:
    from kvcached.config import engines_enabled
    from kvcached.engines import enabled

    monkeypatch.setenv("ENABLE_KVCACHED", value)
    assert engines_enabled() is on
    assert enabled() is on  # the engines ask config.py, read fresh on every call


_PRODUCT = ("kvcached", "backends", "engines", "apps", "conformance")


def _environment_reads(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, variable) of every read of a kvcached variable in `path`: os.environ.get,
    os.environ[...] and os.getenv with a literal KVCACHED_* or ENABLE_KVCACHED name."""
    import ast

    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        name: ast.expr | None = None
        getters = ("os.environ.get", "os.getenv", "environ.get", "getenv")
        if isinstance(node, ast.Call) and node.args and ast.unparse(node.func) in getters:
            name = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            name = node.slice if ast.unparse(node.value) in ("os.environ", "environ") else None
        text = name.value if isinstance(name, ast.Constant) else None
        if isinstance(text, str) and (text.startswith("KVCACHED_") or text == "ENABLE_KVCACHED"):
            found.append((node.lineno, text))
    return found


def test_no_product_module_but_config_reads_a_kvcached_variable() -> None:
    root = pathlib.Path(__file__).resolve().parents[1]
    reads = {
        f"{path.relative_to(root)}:{line}": name
        for folder in _PRODUCT
        for path in sorted((root / folder).rglob("*.py"))
        if path != root / "kvcached" / "config.py"
        for line, name in _environment_reads(path)
    }
    assert reads == {}


def test_the_scan_finds_a_read_outside_config(tmp_path: pathlib.Path) -> None:
    module = tmp_path / "reads.py"
    module.write_text(
        "import os\nA = os.environ.get('KVCACHED_BACKEND')\nB = os.environ['ENABLE_KVCACHED']\n"
        "C = os.environ.get('HOME')\n"
    )
    assert _environment_reads(module) == [(2, "KVCACHED_BACKEND"), (3, "ENABLE_KVCACHED")]
