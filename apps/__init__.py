"""Applications: what users run on top of the engines and the core.

The CLI (`kvcached`), `kvctl`, `kvtop` and the demos live here. They may import the
engine adapters (`kvcached.engines`) and the core (`kvcached`); nothing below imports
them, and the import contracts in pyproject.toml (`make lint`) hold that line.

A top-level folder mapped into the namespace (package-dir), like `engines/` and
`backends/`: each layer is a folder a newcomer sees, and `kvcached/` holds the core only.
"""
