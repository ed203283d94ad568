from collections.abc import Sequence

def reduce(
    op: int, dtype: int, addresses: Sequence[int], numels: Sequence[int], threads: int
) -> float: ...
