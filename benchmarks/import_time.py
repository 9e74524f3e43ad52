"""How long `import kvcached` (and backend detection) adds to a process's start.

Each figure is the median wall time of fresh interpreters running one statement,
minus the median of an interpreter that runs nothing; all variants alternate in one
loop, so machine drift hits them equally. One JSON object per line.

    python benchmarks/import_time.py [--runs 21]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

VARIANTS = {
    "baseline": "pass",
    "import kvcached": "import kvcached",
    "import + detect": "import kvcached; kvcached.availability()",
    "import + resolve": "from kvcached import registry; registry.resolve_name()",
    "import torch (reference)": "import torch",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.runs):
        for name, code in VARIANTS.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            samples[name].append((time.perf_counter() - start) * 1e3)
    baseline = statistics.median(samples["baseline"])
    for name, values in samples.items():
        median = statistics.median(values)
        print(
            json.dumps(
                {
                    "bench": "import_time",
                    "variant": name,
                    "median_ms": round(median, 1),
                    "added_ms": round(median - baseline, 1),
                    "runs": args.runs,
                }
            )
        )


if __name__ == "__main__":
    main()
