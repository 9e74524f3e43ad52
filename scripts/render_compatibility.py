"""Render the compatibility matrix's JSON results into docs/compatibility.md.

Each file in tests/matrix/results/ is one engine's column, written by
tests/matrix/harness.py (CPU) or scripts/matrix-gpu.sh (H200); a row missing from a
column is shown as not run, saying so. The page is generated: edit the JSON or this
script, never the Markdown.

    python scripts/render_compatibility.py [--results DIR] [--out docs/compatibility.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: columns in this order; a result file for another engine key is appended after them
COLUMNS = ("vllm-cpu", "vllm-gpu", "sglang-gpu")
SYMBOLS = {
    "equal": "✅ equal",
    "different_tokens": "❌ different tokens",
    "crash_at_start": "❌ crash at start",
    "crash": "❌ crash",
    "refused": "➖ refused",  # noqa: RUF001
    "not_run": "⏳ not run",
}


def load(results: Path) -> dict[str, dict[str, Any]]:
    """Every result file in `results`, by its engine key; a malformed one is an error."""
    tables: dict[str, dict[str, Any]] = {}
    for path in sorted(results.glob("*.json")):
        table = json.loads(path.read_text())
        for key in ("engine", "label", "rows"):
            if key not in table:
                raise ValueError(
                    f"{path}: no {key!r} field (a harness result has engine, label, rows)"
                )
        for row in table["rows"]:
            if row.get("outcome") not in SYMBOLS:
                raise ValueError(
                    f"{path}: row {row.get('architecture')!r} has outcome {row.get('outcome')!r}; "
                    f"accepted: {', '.join(SYMBOLS)}"
                )
        tables[table["engine"]] = table
    return tables


#: the reason shown for a row that a column's result file lacks (the column's label
#: names its engine and machine, e.g. "vLLM-GPU 0.26.0 (H200)")
NOT_IN_COLUMN = "not yet run on {label}: the row is newer than this column's last run"


def _cell(row: dict[str, Any] | None, notes: list[str], label: str) -> str:
    if row is None:
        row = {"outcome": "not_run", "detail": NOT_IN_COLUMN.format(label=label)}
    text = SYMBOLS[row["outcome"]]
    ratio = row.get("throughput_ratio")
    if ratio is not None:
        text += f", {ratio:.2f}x throughput"
        if row.get("throughput_of") == "last run":
            text += " (last run)"
    cell_notes = []
    if row["outcome"] != "equal" and row.get("detail"):
        cell_notes.append(str(row["detail"]))
    elif "corruption" in row:
        verdict = row["corruption"]
        if _corruption_caught(verdict):
            text += ", corruption caught"
        else:
            cell_notes.append(f"the corruption run proved nothing: {json.dumps(verdict)}")
    if row.get("note"):  # how the run was made, whatever its outcome (the harness's)
        cell_notes.append(str(row["note"]))
    for note in cell_notes:
        note = note.replace("|", "\\|").replace("\n", " ")
        if note not in notes:  # one footnote per distinct reason
            notes.append(note)
        text += f" [{notes.index(note) + 1}]"
    return text


def _corruption_caught(verdict: dict[str, Any]) -> bool:
    """The harness's corruption run swapped held blocks and the tokens changed after it
    (and not before): the cell's equality could have failed."""
    return (
        "error" not in verdict
        and verdict.get("swapped_blocks", 0) >= 2
        and bool(verdict.get("equal_before"))
        and bool(verdict.get("changed_tokens"))
    )


#: the side-by-side overhead runs, on Qwen3 shapes (the `standard-gqa` row)
_Q06, _Q8B = "Qwen3-0.6B", "Qwen3-8B"
OVERHEAD_RUNS = (  # (engine, model shape, file)
    ("vLLM 0.26", _Q8B, "benchmarks/results/h200-2026-12-02/vllm_overhead_8b.jsonl"),
    ("vLLM 0.26", _Q06, "benchmarks/results/h200-2026-12-01/vllm_overhead_first.jsonl"),
    ("vLLM 0.26", _Q06, "benchmarks/results/h200-2026-12-01/vllm_overhead_v1.jsonl"),
    ("vLLM 0.26", _Q06, "benchmarks/results/h200-2026-12-01/vllm_overhead_v1_1024.jsonl"),
    ("vLLM 0.26", _Q06, "benchmarks/results/h200-2026-12-01/vllm_overhead_v1_side_by_side.jsonl"),
    ("vLLM 0.26", _Q06, "benchmarks/results/h200-2026-12-01/vllm_overhead_v2_side_by_side.jsonl"),
    ("SGLang 0.5.16", _Q8B, "benchmarks/results/h200-2026-12-03/sglang_overhead_8b.jsonl"),
    ("SGLang 0.5.16", _Q06, "benchmarks/results/h200-2026-12-01/sglang_overhead.jsonl"),
)


def _summary(path: Path) -> dict[str, Any] | None:
    """The summary line of an overhead result file (vLLM's and SGLang's name it differently)."""
    if not path.exists():
        return None
    for line in reversed(path.read_text().splitlines()):
        record = json.loads(line) if line.strip() else {}
        if record.get("bench") == "vllm_overhead_summary" or record.get("step") == "summary":
            return record
    return None


def _matrix_ratio(row: dict[str, Any] | None) -> str:
    """A GPU cell's one-run throughput ratio, or why the cell has none."""
    if row is None or row.get("outcome") != "equal":
        return "no equal run"
    if "throughput_ratio" in row:
        return f"{row['throughput_ratio']}x"
    if "left out" in str(row.get("detail", "")):
        return "left out: the engine alone compiled this row's kernels in its timed run"
    return "not measured"


def _per_architecture(tables: dict[str, dict[str, Any]]) -> list[str]:
    """Every architecture's throughput ratio in the GPU columns, the one figure the matrix
    has for each (one run a side, the engine alone first)."""
    from kvcached.testing.random_arch import ARCHITECTURES

    gpu = [key for key in COLUMNS if key in tables and key.endswith("-gpu")]
    ratios = [
        float(row["throughput_ratio"])
        for key in gpu
        for row in tables[key]["rows"]
        if row.get("outcome") == "equal" and "throughput_ratio" in row
    ]
    if not ratios:
        return []
    lines = [
        "Per architecture, the matrix's own runs are the only figure yet: one run a side, the",
        "engine alone first, on the column's machine. A ratio well above 1 is the engine",
        "alone compiling kernels (torch.compile, Triton, JIT attention) inside its timed run",
        "and the kvcached run finding them cached, not kvcached being faster; where the row",
        "says so, the ratio is left out. So these bound no cost: they show no row where",
        "keeping the engine's layout made kvcached's run clearly slower (the lowest,",
        f"{min(ratios)}x, is one run). A paired run per architecture, as the Qwen3 rows have",
        "above, is not made yet.",
        "",
        "| architecture | " + " | ".join(tables[key]["label"] for key in gpu) + " |",
        "|---|" + "---|" * len(gpu),
    ]
    columns = [{row["architecture"]: row for row in tables[key]["rows"]} for key in gpu]
    for name in ARCHITECTURES:
        cells = [_matrix_ratio(column.get(name)) for column in columns]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines


def _layout_section(tables: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "## KV layout",
        "",
        "Upstream kvcached's matrix has contiguous and non-contiguous layout columns; this",
        "kvcached has no layout of its own. It keeps each engine's: vLLM's per-layer KV",
        "tensors with the shapes and strides vLLM's attention backend asks for",
        "(`engines/vllm/allocation.py`), SGLang's per-layer K and V buffers in its NHD layout",
        "(`engines/sglang/buffers.py`), mlx-lm's per-layer K and V arrays",
        "(`engines/mlx_lm/cache.py`). The kernels run unchanged; what that costs is the",
        "throughput ratio kvcached / engine alone, measured side by side (paired, with an",
        "interval) for `standard-gqa` (Qwen3 shapes):",
        "",
        "| architecture | shape | engine | runner | ratio | paired ratio [95 % interval] |"
        " greedy equal | file |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for engine, shape, name in OVERHEAD_RUNS:
        record = _summary(ROOT / name)
        if record is None:
            continue
        ratio = record.get("ratio", record.get("throughput_ratio"))
        equal = record.get("greedy_equal", record.get("equal"))
        runner = record.get("runner", "-")
        paired = "-"
        if record.get("pairs"):
            low, high = record["paired_ratio_ci95"]
            paired = f"{record['paired_ratio_median']} [{low}, {high}], {record['pairs']} pairs"
        lines.append(
            f"| `standard-gqa` | {shape} | {engine} | {runner} | {ratio} | {paired} "
            f"| {'yes' if equal else 'no'} | `{name}` |"
        )
    lines += [
        "",
        "The ratio is the file's summary line (vLLM: `ratio`, steady batches; SGLang:",
        "`throughput_ratio`, of median tokens/s); the paired ratio and its bootstrap",
        "interval, where the file has them, come from `benchmarks/paired_ratios.py`. The",
        "Qwen3-8B runs (2K-6K-token prompts, CUDA graphs on, 20-21 pairs) decide both",
        "engines' case: kvcached over vLLM's own layout costs 0.05-0.2 % (interval of the",
        "paired ratio), over SGLang's at most 0.07 % (its interval reaches 0.67 % faster).",
        "The Qwen3-0.6B runs are host-bound and noisy: the paired ratios within one run spread",
        "more than the differences between runs",
        "(`benchmarks/results/h200-2026-12-01/README.md`), so they decide nothing.",
        "",
        *_per_architecture(tables),
    ]
    return lines


def _connector_section() -> list[str]:
    """vLLM's KV connectors: the adapter's own table of what it serves (`SERVED`, with
    where each was proven) and why the others it knows are refused (`NOT_YET`)."""
    from kvcached.engines.vllm.connectors import NOT_YET, SERVED

    lines = [
        "## KV connectors (vLLM)",
        "",
        "What the vLLM adapter serves under `kv_transfer_config` / `kv_offloading_size`,",
        "read from `engines/vllm/connectors.py`; any other connector is refused at start-up",
        "naming it and the ones served. Details and figures:",
        "[vLLM](engines/vllm.md#kv-connectors).",
        "",
        "| connector | vLLM | with kvcached | why, and the equality run |",
        "|---|---|---|---|",
    ]
    for served in SERVED:
        lines.append(
            f"| `{served.name}` | {', '.join(served.versions)} | served | {served.why}; "
            f"{served.proof} |"
        )
    for name, why in NOT_YET.items():
        versions = [v for s in SERVED if s.name == name for v in s.versions]
        where = f"all but {', '.join(versions)}" if versions else "all"
        lines.append(f"| `{name}` | {where} | refused | {why} |")
    return lines


def render(tables: dict[str, dict[str, Any]]) -> str:
    from kvcached.testing.random_arch import ARCHITECTURES

    engines = [key for key in COLUMNS if key in tables] + sorted(set(tables) - set(COLUMNS))
    notes: list[str] = []
    head = ["architecture", "representative", "why it is hard"]
    head += [tables[key]["label"] for key in engines]
    lines = [
        "# Compatibility matrix",
        "",
        "<!-- generated by scripts/render_compatibility.py from tests/matrix/results/*.json;"
        " do not edit -->",
        "",
        "Greedy tokens of each architecture with kvcached against the engine alone, on",
        "random-weight models built from the representative's real config (scaled down on",
        "CPU, keeping the layer pattern, sliding windows, KV sharing and per-layer KV shapes;",
        "`kvcached/testing/random_arch.py`). The batch spans many extents and passes the sliding",
        "windows. ✅ equal · ❌ crash or different tokens · ➖ refused at start-up, with the",  # noqa: RUF001
        "message · ⏳ not run here, with the reason. Throughput is tokens/s with kvcached",
        "over without, where measured: one run each, the engine alone first (kernels compiled",
        "on first use are then cached for the second run), so a rough figure, not an overhead",
        "measurement; *(last run)*: of the batch's last run on each side, after a first run",
        "that compiled what it needed; `benchmarks/vllm_overhead.py` and",
        "`benchmarks/sglang_overhead.py`",
        "measure that side by side. *Corruption caught*: after its clean runs the kvcached",
        "engine ran the batch once more with the held KV blocks swapped (vLLM: midway",
        "through the decode; SGLang: the radix cache's pages, while idle), as a wrongly",
        "mapped page would, and the tokens changed, so that cell's comparison can fail;",
        "cells without it come from runs made before that check existed.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for name, arch in ARCHITECTURES.items():
        cells = [f"`{name}`", f"{arch.representative} (`{arch.architecture}`)", arch.why_hard]
        for key in engines:
            by_name = {row["architecture"]: row for row in tables[key]["rows"]}
            cells.append(_cell(by_name.get(name), notes, tables[key]["label"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *_layout_section(tables)]
    lines += ["", *_connector_section()]
    lines += ["", "## Notes", ""]
    lines += [f"{i}. {note}" for i, note in enumerate(notes, 1)]
    lines += ["", "## Runs", ""]
    for key in engines:
        table = tables[key]
        run = f"{table.get('date', '?')}, {table.get('host', '?')}"
        lines.append(f"- {table['label']}: {run}; `{table.get('command', '?')}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "tests" / "matrix" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "compatibility.md")
    args = parser.parse_args(argv)
    args.out.write_text(render(load(args.results)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
