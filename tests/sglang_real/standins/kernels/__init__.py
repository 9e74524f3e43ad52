"""Hidden for the SGLang CPU checks (see ../README.md)."""

raise ImportError("kernels is hidden for the SGLang CPU checks")
