"""Two fx helpers every graph pass needs, kept below all of them (no fxq imports) so any pass can use them."""
from __future__ import annotations

from typing import Any

from torch import fx

__all__ = ["get_attr_value", "redirect_later_readers"]


def get_attr_value(gm: fx.GraphModule, target: str) -> Any:
    """The object a ``get_attr`` target (``"layer1.0.conv1.weight"``) names in ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def redirect_later_readers(written: fx.Node, new_value: fx.Node, writer: fx.Node, order: dict[fx.Node, int]) -> None:
    """Make the readers of ``written`` that come after ``writer`` (by ``order``, node -> position) read
    ``new_value``: how an in-place write becomes an out-of-place one without changing what the graph computes."""
    for user in [u for u in written.users if order.get(u, -1) > order[writer]]:
        user.replace_input_with(written, new_value)
