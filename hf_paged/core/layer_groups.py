"""Which K/V layers share a block table: the grouping of a mixed sliding / full attention stack (pure Python).

Why groups: a mixed stack (Gemma 2/3's 5 local : 1 global layers, gpt-oss, Cohere 2, Qwen2 with
`max_window_layers`) cannot release a block out of the local layers' window while one table serves every layer: the
global layers still read it. With one table per *group* of layers, the sliding groups' tables release what fell out
of their window (`hf_paged.core.block_groups`) and only the full groups keep every block.

The layout (vLLM v1's hybrid allocator, written anew here), layers of one shape: all groups have the same number of
layers, ``group_size``
(the fewest layers of any kind, so the full layers make whole groups), and one block id holds that many layers' K/V.
The pool has ``group_size`` *slot* tensors; layer ``l`` reads and writes slot tensor ``slot_of[l]`` (its position in
its group) through its group's table. Layers at the same position of different groups alias one tensor, which is
safe because a block id belongs to one group's tables at a time (one allocator, no cross-group sharing: prefix-cache
keys are salted by group). A kind whose layers do not fill their last group pads it (those slots' memory goes
unused for that group's blocks). Gemma-3-27B: 62 layers = 10 full + 52 sliding -> ``group_size`` 10, one full group
and six sliding groups (the last one holds 2 layers), so a block id costs 10 layers instead of 62.

Layers of different sizes (Gemma 4: local layers of ``head_dim`` 256, global layers of ``global_head_dim`` 512 and
their own KV heads): a block id is a *page* of ``page_width`` elements per token, and each layer of a group has its
own ``offset`` in it (`LayerGroups.layout`, given each layer's elements per token). The plan packs each kind's layers,
in layer order, into groups whose widths add up to at most the page, the page being the smallest kind's whole width
(so that kind makes one group) or the widest layer's. Layers of one width give exactly the plan above (offsets are
slot positions times that width); layers at one offset of different groups alias, as slots do. Gemma-4-31B-like
(50 local layers of 16 heads x 256, 10 global of 4 heads x 512, K and V): page = the 10 global layers' 40960
elements a token = 5 local layers, so 1 full and 10 sliding groups and no padding.

Scope: a stack with at least one full and one sliding K/V layer; `plan_layer_groups` returns None otherwise and the
cache keeps its one table (today's behaviour).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_GROUPS", "LayerGroups", "config_layer_windows", "plan_layer_groups"]

#: most layer groups of a plan; a stack that would need more keeps one table. Why a bound: the scheduler's work per
#: decode step grows with the groups (each sequence has a table per group: about 2.2 ms against 0.16 ms for 256
#: sequences and 7 groups on the CPU sandbox), so a stack of one global layer per 40 local ones would pay more on
#: the host than its memory saves; Gemma 2/3, gpt-oss and Cohere 2 need 2 to 7. (`block_groups.group_salt` keeps a
#: group's index in a byte: at most 255 in any case.)
MAX_GROUPS = 16


@dataclass(frozen=True)
class LayerGroups:
    """The grouping of a pool's K/V layers (pool order): see the module docstring.

    ``windows[g]``: group ``g``'s sliding window in tokens (None: full attention, keeps every block);
    ``members[g]``: its pool layers, at most ``group_size``; ``group_of[i]`` / ``slot_of[i]``: pool layer ``i``'s
    group and position in it (its slot tensor when every layer has one shape). ``widths``: each pool layer's
    elements per token the plan packed (empty: every layer one unit). Group 0 is always a full group (its table is
    the one the rest of hf-paged sees).
    """

    group_size: int
    windows: tuple[int | None, ...]
    members: tuple[tuple[int, ...], ...]
    group_of: tuple[int, ...]
    slot_of: tuple[int, ...]
    widths: tuple[int, ...] = ()

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def layer_windows(self) -> list[int | None]:
        """Each pool layer's window, as planned (what the attention calls must confirm: `matches`)."""
        return [self.windows[g] for g in self.group_of]

    def matches(self, windows: Sequence[int | None]) -> bool:
        """Whether the windows the layers' attention calls passed (pool order) are the planned ones."""
        return list(windows) == self.layer_windows()

    def layout(self, widths: Sequence[int]) -> tuple[tuple[int, ...], int]:
        """``(offset_of, page_width)`` of pool layers `widths` wide (elements per token): each layer's offset in a
        block's page (the widths of its group's earlier members) and the page, the widest group's sum. Why widths
        given here and not the planned ones: a tensor-parallel rank holds its share of every layer's heads."""
        if len(widths) != len(self.group_of):
            raise ValueError(f"widths must give {len(self.group_of)} layers' widths, got {len(widths)}")
        offsets = [0] * len(widths)
        page = 0
        for members in self.members:
            at = 0
            for layer in members:
                offsets[layer], at = at, at + widths[layer]
            page = max(page, at)
        return tuple(offsets), page


def plan_layer_groups(windows: Sequence[int | None], widths: Sequence[int] | None = None) -> LayerGroups | None:
    """The groups of K/V layers whose windows are `windows` (pool order; None: full attention), or None when grouping
    gains nothing: every layer full, or every layer sliding (the one-table release of `hf_paged.core.window`
    already frees those).

    Layers of one window form one kind. `widths` (each layer's elements per token; None: all alike): the page is the
    smallest kind's whole width, or the widest layer's if that is more, and each kind is cut, in layer order, into
    groups of at most a page (the last padded). With one width that is ``group_size`` layers a group, the fewest of
    any kind. Full groups come first. None as well past `MAX_GROUPS` groups.
    """
    if not windows:
        return None
    for w in windows:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"a layer's sliding window must be a positive int or None, got {w!r}")
    units = [1] * len(windows) if widths is None else list(widths)
    if len(units) != len(windows) or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in units):
        raise ValueError(f"widths must be {len(windows)} positive ints (one per layer), got {widths!r}")
    kinds: dict[int | None, list[int]] = {}
    for index, w in enumerate(windows):
        kinds.setdefault(w, []).append(index)
    if None not in kinds or len(kinds) < 2:
        return None
    page = max(min(sum(units[i] for i in layers) for layers in kinds.values()), max(units))
    group_windows: list[int | None] = []
    members: list[tuple[int, ...]] = []
    for w in [None] + sorted(w for w in kinds if w is not None):
        chunk: list[int] = []
        for layer in kinds[w]:
            if chunk and sum(units[i] for i in chunk) + units[layer] > page:
                members.append(tuple(chunk))
                group_windows.append(w)
                chunk = []
            chunk.append(layer)
        members.append(tuple(chunk))
        group_windows.append(w)
    if len(members) > MAX_GROUPS:
        return None
    group_of = [0] * len(windows)
    slot_of = [0] * len(windows)
    for group, chunk in enumerate(members):
        for slot, layer in enumerate(chunk):
            group_of[layer], slot_of[layer] = group, slot
    return LayerGroups(max(map(len, members)), tuple(group_windows), tuple(members), tuple(group_of), tuple(slot_of),
                       () if widths is None else tuple(units))


def config_layer_windows(config, num_layers: int) -> list[int | None] | None:
    """Each decoder layer's sliding window as a transformers config declares it (``layer_types`` with
    "sliding_attention" / "full_attention" and ``sliding_window``), or None when the config does not say (no
    ``layer_types``, another layer kind such as "chunked_attention" or a recurrent mixer, no window).

    Why the config: the pool is laid out before any forward; the engine then checks the plan against the windows
    the attention calls actually pass (`LayerGroups.matches`) before any block is released.
    """
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if not isinstance(types, (list, tuple)) or len(types) != num_layers or not isinstance(window, int) or window < 1:
        return None
    out: list[int | None] = []
    for kind in types:
        if kind == "sliding_attention":
            out.append(window)
        elif kind == "full_attention":
            out.append(None)
        else:
            return None
    return out
