# Types of the C module backends/cuda/_vmm_calls.c (see the top of that file).
from collections.abc import Callable
from typing import Any

class VmmCalls:
    def __init__(
        self,
        map: int,
        set_access: int,
        unmap: int,
        location_type: int,
        location_id: int,
        access_flags: int,
        on_error: Callable[[str, int, int, Any], Any],
    ) -> None: ...
    @property
    def access(self) -> tuple[int, int, int]: ...
    def map(self, address: int, page: Any) -> Any: ...
    def unmap(self, address: int, nbytes: int) -> Any: ...
