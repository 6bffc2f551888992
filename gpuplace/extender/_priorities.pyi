from typing import Any

def ranked_json(hosts: list[str], chosen: list[Any], ten: int, /) -> bytes | None:
    """`chosen`: per host, None or an object with a float `score`."""
