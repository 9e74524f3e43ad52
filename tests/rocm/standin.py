"""Build the libamdhip64.so stand-ins and point hip-python at them.

Two variants, one C file each (see their header comments):

* ``host`` simulates HIP's VMM API in host memory, with switches that reproduce three
  ROCm bugs; the ROCm backend runs the conformance suite on it anywhere.
* ``cuda`` forwards the same calls to the CUDA driver, so the backend maps real device
  memory on an NVIDIA GPU.

A build is a ROCm-like tree, ``<out>/<variant>/lib/libamdhip64.so``, compiled with the
system C compiler (``$CC``, else ``cc``). hip-python is pointed at it the ways hip-python
itself supports, both set by `environment()`:

* ``ROCM_PATH=<out>/<variant>``: hip-python 10.x resolves the runtime to
  ``$ROCM_PATH/lib/libamdhip64.so`` (after a copy bundled in its wheel and the
  ``rocm_sdk`` package, neither of which a test machine has);
* ``LD_LIBRARY_PATH=<out>/<variant>/lib``: hip-python 6.x/7.x dlopen the bare name
  ``libamdhip64.so``, which the loader searches there. The loader reads
  LD_LIBRARY_PATH when a process starts, so this one only works for child processes.

Both take effect at hip-python's first call in a process, which caches the library for
the life of the process: a test process can use one stand-in, so tests that need
another (or a real runtime) run in a child process.

Run as a script to build one variant and print the environment to use:

    python tests/rocm/standin.py --variant cuda --out /tmp/hipstandin
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = {"host": "hipstandin_host.c", "cuda": "hipstandin_cuda.c"}
LIBS = {"host": ["-lpthread"], "cuda": ["-ldl", "-lpthread"]}
CFLAGS = ["-std=c11", "-O2", "-g", "-Wall", "-Wextra", "-fPIC", "-fvisibility=hidden"]

#: hipDeviceAttribute_t members the stand-ins answer, and their -D names in hipstandin.h.
ATTRIBUTES = {
    "hipDeviceAttributeVirtualMemoryManagementSupported": "HIPSTANDIN_ATTR_VMM",
    "hipDeviceAttributeIntegrated": "HIPSTANDIN_ATTR_INTEGRATED",
    "hipDeviceAttributeComputeCapabilityMajor": "HIPSTANDIN_ATTR_CC_MAJOR",
    "hipDeviceAttributeComputeCapabilityMinor": "HIPSTANDIN_ATTR_CC_MINOR",
    "hipDeviceAttributeMultiprocessorCount": "HIPSTANDIN_ATTR_SM_COUNT",
}


class BuildError(RuntimeError):
    """The C compiler is missing or rejected a stand-in."""


def compiler() -> str | None:
    """The C compiler to use, or None when this machine has none."""
    name = os.environ.get("CC", "cc")
    return shutil.which(name)


def attribute_defines() -> list[str]:
    """-D flags with the device attribute numbers of the installed hip-python.

    Attribute numbers are the part of HIP's ABI that has moved between releases; the
    stand-in must answer to the numbers the bindings in use send. Importing the bindings
    loads no HIP runtime."""
    try:
        from hip import hip
    except ImportError:
        return []  # the defaults in hipstandin.h (hip-python 10.x)
    defines = []
    for member, macro in ATTRIBUTES.items():
        value = getattr(hip.hipDeviceAttribute_t, member, None)
        if value is not None:
            defines.append(f"-D{macro}={int(value)}")
    return defines


def build(variant: str, out: Path) -> Path:
    """Compile `variant` into `out/<variant>/lib/libamdhip64.so`; returns `out/<variant>`."""
    cc = compiler()
    if cc is None:
        raise BuildError(f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH")
    root = Path(out) / variant
    library = root / "lib" / "libamdhip64.so"
    library.parent.mkdir(parents=True, exist_ok=True)
    command = [
        cc,
        *CFLAGS,
        *attribute_defines(),
        "-shared",
        "-Wl,-soname,libamdhip64.so",
        "-o",
        str(library),
        str(HERE / SOURCES[variant]),
        *LIBS[variant],
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BuildError(f"{shlex.join(command)} failed:\n{done.stderr}")
    return root


def environment(root: Path, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (default: this process's environment) with hip-python pointed at `root`."""
    env = dict(os.environ if base is None else base)
    lib = str(Path(root) / "lib")
    env["ROCM_PATH"] = str(root)
    env.pop("ROCM_HOME", None)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH", "")) if p)
    env.update(extra)
    return env


class Stats(ctypes.Structure):
    """`struct hipstandin_stats` of hipstandin_host.c: counters the tests assert on."""

    _fields_ = [
        (name, ctypes.c_ulonglong)
        for name in (
            "reservations",
            "mappings",
            "allocations",
            "held_bytes",
            "process_bytes",
            "unmap_calls",
            "multi_unmap_calls",
            "setaccess_calls",
            "setaccess_rejected_by_bug",
            "address_free_calls",
            "address_reserve_calls",
            "address_misses",
            "stale_ranges",
        )
    ]


def stats(root: Path) -> Stats:
    """The host stand-in's counters, as loaded into this process by hip-python."""
    library = ctypes.CDLL(str(Path(root) / "lib" / "libamdhip64.so"))
    out = Stats()
    library.hipstandin_stats(ctypes.byref(out), ctypes.c_size_t(ctypes.sizeof(out)))
    return out


def miss_requested_addresses(root: Path, count: int) -> None:
    """Make the host stand-in give the next `count` hipMemAddressReserve calls that would
    be granted the address they ask for another one (as if someone took the range)."""
    library = ctypes.CDLL(str(Path(root) / "lib" / "libamdhip64.so"))
    library.hipstandin_miss_requested_addresses(ctypes.c_ulong(count))


def loaded_runtimes() -> list[str]:
    """Paths of every libamdhip64 mapped into this process."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "libamdhip64" in line})


def run_python(
    code: str, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter (this one's) with `env`, from a scratch folder so
    that no project folder on the path shadows the installed package metadata."""
    with tempfile.TemporaryDirectory() as scratch:
        return subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            cwd=scratch,
            timeout=timeout,
            check=False,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=sorted(SOURCES), default="host")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    try:
        root = build(args.variant, args.out)
    except BuildError as exc:
        sys.exit(str(exc))
    lib = shlex.quote(str(root / "lib"))
    print(f"export ROCM_PATH={shlex.quote(str(root))}")
    print(f"export LD_LIBRARY_PATH={lib}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}")


if __name__ == "__main__":
    main()
