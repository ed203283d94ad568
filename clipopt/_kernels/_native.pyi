from collections.abc import Sequence
from typing import Any

def reduce(
    op: int, dtype: int, addresses: Sequence[int], numels: Sequence[int], threads: int
) -> float: ...
def scale(
    dtype: int,
    addresses: Sequence[int],
    numels: Sequence[int],
    coefficient_address: int,
    coefficient_dtype: int,
    threads: int,
) -> None: ...
def float16_by_f16c(enabled: bool) -> bool: ...
def grads(params: Sequence[Any]) -> list[Any]: ...
def any_instance(objects: Sequence[Any], cls: type) -> bool: ...
