"""The site's generated pages: each committed page equals a fresh render of its source.

The site itself (`mkdocs build --strict`, every page in the nav, no broken link) is
built by `make docs`; these tests need no MkDocs.
"""

from __future__ import annotations

import re
import sys
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import render_cli_reference  # noqa: E402
import render_performance  # noqa: E402
import render_shims  # noqa: E402


def test_committed_cli_reference_is_rendered_from_the_installed_commands() -> None:
    page = (ROOT / "docs" / "cli.md").read_text()
    assert page == render_cli_reference.render()  # regenerate, never edit by hand


def test_committed_performance_page_is_rendered_from_the_committed_results() -> None:
    page = (ROOT / "docs" / "performance.md").read_text()
    assert page == render_performance.render()  # regenerate, never edit by hand


def test_committed_shim_tables_page_is_rendered_from_the_adapters_tables() -> None:
    page = (ROOT / "docs" / "engines" / "shims.md").read_text()
    assert page == render_shims.render()  # regenerate, never edit by hand


def test_shim_tables_page_lists_every_entry_of_both_tables() -> None:
    from kvcached.engines.sglang import shims as sglang_shims
    from kvcached.engines.vllm import shims as vllm_shims

    page = render_shims.render()
    for module in (vllm_shims, sglang_shims):
        for entry in (*module.SHIMS, *module.CONTACTS):
            assert f"| `{entry.target}` |" in page, entry.target
    # the internals the issue found missing from the old tables are on the page
    for name in ("_maybe_evict_cached_block", "EngineCoreRequestType", "get_num_new_pages"):
        assert name in page
    assert "engines/shims.md" in (ROOT / "mkdocs.yml").read_text()


def test_cli_reference_covers_every_command_and_option_of_each_script() -> None:
    page = render_cli_reference.render()
    for name, command in render_cli_reference.commands():
        subcommands = getattr(command, "commands", {}) or {"": command}
        for sub_name, sub in subcommands.items():
            assert f"{name} {sub_name}".strip() in page
            for param in sub.params:
                for option in param.opts:
                    assert f"{option}" in page, (name, sub_name, option)


def _module_with(monkeypatch: pytest.MonkeyPatch, **members: object) -> str:
    module = types.ModuleType("kvcached_fake_cli")
    for key, value in members.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__name__


def test_cli_reference_finds_the_app_behind_an_entry_points_main(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the scripts' entry points name `main`, a function that runs the app: the renderer
    # follows the entry point to its module, wherever the module has moved, and takes
    # the app from there
    app = typer.Typer()
    module = _module_with(monkeypatch, app=app, main=lambda: app())
    ep = EntryPoint(name="fake", value=f"{module}:main", group="console_scripts")
    assert render_cli_reference.typer_app(ep) is app


def test_cli_reference_refuses_a_module_with_two_apps_naming_the_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = _module_with(monkeypatch, one=typer.Typer(), two=typer.Typer(), main=print)
    ep = EntryPoint(name="fake", value=f"{module}:main", group="console_scripts")
    with pytest.raises(LookupError, match=f"fake = {module}:main"):
        render_cli_reference.typer_app(ep)


def test_performance_page_names_a_results_file_that_no_section_describes(
    tmp_path: Path,
) -> None:
    # a new run lands on the page (named, undescribed) as soon as the page is rendered
    for section in render_performance.SECTIONS:
        for name in section.files:
            target = tmp_path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text((render_performance.RESULTS / name).read_text())
    (tmp_path / "h200-2030-01-01").mkdir()
    (tmp_path / "h200-2030-01-01" / "new_bench.jsonl").write_text('{"bench": "new"}\n')
    page = render_performance.render(tmp_path)
    assert "- `benchmarks/results/h200-2030-01-01/new_bench.jsonl`" in page


def test_performance_page_names_the_file_and_machine_of_every_table() -> None:
    page = render_performance.render()
    for section in render_performance.SECTIONS:
        block = page.split(f"### {section.title}\n", 1)[1].split("\n### ", 1)[0]
        for name in section.files:
            assert f"`benchmarks/results/{name}`" in block
        machine = render_performance.MACHINES[render_performance.machine_key(section.files[0])]
        assert machine in block


def test_committed_overhead_plot_shows_every_overhead_cell_with_an_interval() -> None:
    # the SVG keeps its labels as text (svg.fonttype none): each cell the page's overhead
    # sections have an interval for is in it, so a new run cannot leave the plot stale
    points = render_performance.overhead_points()
    assert points, "no overhead summary with a paired-ratio interval: nothing to plot"
    svg = render_performance.PLOT.read_text()
    missing = [label for label, *_ in points if f">{label}<" not in svg]
    assert not missing, f"regenerate with scripts/render_performance.py: {missing}"


def test_overhead_plot_is_drawn_from_the_points(tmp_path: Path) -> None:
    target = tmp_path / "plot.svg"
    render_performance.plot_overhead([("cell-a", 0.995, 0.99, 1.0), ("cell-b", 0.9, 0.85, 0.93)],
                                     target)  # fmt: skip
    svg = target.read_text()
    assert ">cell-a<" in svg and ">cell-b<" in svg and ">cell-c<" not in svg


def test_step_parts_divide_each_cells_own_batches() -> None:
    # a sweep's file holds its cells one after the other, each cell's batches before its
    # summary: a cell's scheduler quotient comes from its batches alone
    def batch(kvcached: bool, scheduler: float) -> dict[str, object]:
        parts = {"schedule": scheduler, "update_from_output": 0.0,
                 "execute_model": 1.0, "sample_tokens": 0.0}  # fmt: skip
        return {"bench": "vllm_overhead", "kvcached": kvcached, "batch": 1, "host_s": parts}

    def summary(label: str) -> dict[str, object]:
        steps = {"step": {"kvcached": 1.0, "vllm": 1.0}}
        return {"bench": "vllm_overhead_summary", "config": {"label": label},
                "host_s_median": steps}  # fmt: skip

    rows = [batch(True, 2.0), batch(False, 1.0), summary("a"),
            batch(True, 3.0), batch(False, 1.0), summary("b")]  # fmt: skip
    lines = render_performance._step_parts({"h/sweep.jsonl": rows})
    quotients = [line.split("|")[-2].strip() for line in lines if "untouched" in line]
    assert quotients == ["2", "3"]


_PER_HANDLE = re.compile(r"(handle|cuMemSetAccess|set-access|set access)", re.IGNORECASE)
_MICROSECONDS = re.compile(r"\d(?:[\d.,\u2013-]*\d)?\s*(?:µs|us)\b")  # ranges: 51-58 µs


def per_handle_figures_without_a_source(text: str) -> list[str]:
    """The paragraphs of `text` that quote a per-handle cost in µs without naming the
    benchmarks/results/ file it comes from."""
    return [
        " ".join(paragraph.split())[:120]
        for paragraph in re.split(r"\n\s*\n|\n\s*[-*] ", text)  # paragraphs, list items
        if _PER_HANDLE.search(paragraph)
        and _MICROSECONDS.search(paragraph)
        and not re.search(r"benchmarks/results/|\w+\.jsonl", paragraph)
    ]


def test_every_per_handle_cost_names_the_results_file_it_comes_from() -> None:
    quoted = [
        *sorted((ROOT / "docs").rglob("*.md")),
        ROOT / "README.md",
        *sorted((ROOT / "kvcached").rglob("*.py")),
        *sorted((ROOT / "engines").rglob("*.py")),
        *sorted((ROOT / "apps").rglob("*.py")),
    ]
    lost = {
        str(path.relative_to(ROOT)): found
        for path in quoted
        if (found := per_handle_figures_without_a_source(path.read_text()))
    }
    assert lost == {}
    unsourced = "Mapping costs ~60 µs per handle whatever its size.\n\nNext paragraph."
    assert per_handle_figures_without_a_source(unsourced) == [
        "Mapping costs ~60 µs per handle whatever its size."
    ]
    sourced = "~60 µs per handle (`benchmarks/results/x/grow_shrink_cuda.jsonl`)."
    assert per_handle_figures_without_a_source(sourced) == []


def _overview(page: str) -> str:
    return page.split("## The sweep's cells at a glance")[1].split("## The benchmarks")[0]


def test_the_cells_overview_lists_every_cell_each_sweep_defines() -> None:
    cells = render_performance.sweep_cells()
    script = (ROOT / "scripts" / "vllm-gpu-run.sh").read_text()
    assert cells["vLLM"] and all(f"{name})" in script for name in cells["vLLM"])
    sglang = (ROOT / "benchmarks" / "sglang_overhead.py").read_text()
    assert cells["SGLang"] and all(f'"{name}": Cell(' in sglang for name in cells["SGLang"])
    overview = _overview(render_performance.render())
    for engine, names in cells.items():
        for name in names:
            assert f"| {engine} | `{name}` |" in overview, (engine, name)


def test_a_cell_without_a_kept_run_reads_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    defined = render_performance.sweep_cells()
    defined["SGLang"] = [*defined["SGLang"], "q70b-huge"]
    monkeypatch.setattr(render_performance, "sweep_cells", lambda: defined)
    overview = _overview(render_performance.render())
    assert "| SGLang | `q70b-huge` | not run |" in overview
    assert "| SGLang | `q8b-short` | not run |" not in overview  # it has a kept run


def test_a_second_vllm_alone_process_is_shown_beside_the_token_check() -> None:
    same = render_performance._same_tokens
    assert same({"greedy_equal": True}) == "yes"
    assert same({"greedy_equal": False, "second_baseline_equal": False}) == (
        "no; vLLM alone again: no"
    )
