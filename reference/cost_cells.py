"""What every rank does in every round, summed per link: the cost model's view of a schedule.

A cell is one (round, rank). For each cell and each kind of link (inside a node, between
nodes) the cost model needs the messages the rank sends and receives there and the chunks (or
bytes) it sends and receives there, and, over both links, the chunks it reduces. Messages are
what the executor sends (``dplab.reference.schedule.messages``): a round's transfers from one
rank to one peer with one op and consecutive chunks go as one message.

Everything here is vectorised over the schedule's columns (``dplab.reference.columns``), a block of
rounds at a time, so the ring at p = 4096 (33.5 M transfers) is summarised in seconds.

    from dplab.reference.cost_cells import cell_blocks
    for r0, r1, cells in cell_blocks(schedule, ranks_per_node=8):  # cells["m_inter"]: (rounds, p)
        ...
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dplab.reference.columns import RoundTable, columns
from dplab.reference.schedule import Schedule

__all__ = ["FIELDS", "cell_blocks", "message_heads"]

# m_*: max(messages sent, messages received) on that link; x_*: max(chunks or bytes sent, received)
# on that link; red: chunks or bytes reduced (received with op 'reduce'), both links together.
FIELDS = ("m_intra", "x_intra", "m_inter", "x_inter", "red")


def message_heads(t: RoundTable, r0: int, r1: int, p: int) -> np.ndarray:
    """For rows of rounds r0..r1-1: True where a row starts a message (``schedule.messages``' rule:
    per round and (src, dst, op), each run of consecutive chunks is one message).

    Args:
        t: the table.
        r0: the first round.
        r1: one past the last.
        p: the number of ranks.

    Returns:
        One bool per row.
    """
    a, b = int(t.starts[r0]), int(t.starts[r1])
    rid = t.round_ids(r0, r1)
    src, dst = t.src[a:b].astype(np.int64), t.dst[a:b].astype(np.int64)
    if b == a or np.bincount(rid * p + src).max() <= 1:
        return np.ones(b - a, bool)  # no rank sends twice in a round: every transfer is a message
    pair = (rid * p + src) * p + dst
    space = (r1 - r0) * p * p
    dense = space <= 4 * (b - a)
    counts = np.bincount(pair, minlength=space) if dense else np.unique(pair, return_counts=True)[1]
    if counts.max() <= 1:
        return np.ones(b - a, bool)  # to distinct peers: still one message each
    chunk, red = t.chunk[a:b].astype(np.int64), t.reduce[a:b]
    order = np.lexsort((chunk, red, dst, src, rid))
    group = (rid * p + src) * p * 2 + dst * 2 + red  # (round, src, dst, op)
    g, c = group[order], chunk[order]
    starts = np.r_[True, (g[1:] != g[:-1]) | (c[1:] != c[:-1] + 1)]
    heads = np.empty(b - a, bool)
    heads[order] = starts
    return heads


def cell_blocks(
    schedule: Schedule | RoundTable,
    ranks_per_node: int,
    chunk_bytes: np.ndarray | None = None,
    max_rows: int = 1 << 20,
) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
    """Per block of rounds [r0, r1): the fields of every cell as (r1 - r0, p) arrays.

    ``chunk_bytes`` None counts chunks (x_*, red in chunks); else it gives each chunk's bytes.

    Args:
        schedule: a schedule, or its table.
        ranks_per_node: ranks per node: a transfer between nodes is "inter", else "intra".
        chunk_bytes: bytes of each chunk, or None to count chunks.
        max_rows: the most rows a block holds.

    Yields:
        (r0, r1, fields): the fields by name ("m_intra", "x_inter", "red", ...), (r1 - r0, p) each.
    """
    t, p = columns(schedule), schedule.world_size
    for r0, r1 in t.blocks(max_rows=max_rows, max_rounds=max(1, (1 << 21) // p)):
        a, b = int(t.starts[r0]), int(t.starts[r1])
        ncell = (r1 - r0) * p
        rid = t.round_ids(r0, r1)
        src, dst = t.src[a:b].astype(np.int64), t.dst[a:b].astype(np.int64)
        cs, cd = rid * p + src, rid * p + dst
        w = None if chunk_bytes is None else chunk_bytes[t.chunk[a:b]]
        heads = message_heads(t, r0, r1, p)
        inter = (src // ranks_per_node) != (dst // ranks_per_node)
        out: dict[str, np.ndarray] = {}
        for name, mask in (("intra", ~inter), ("inter", inter)):
            if not mask.any():
                out["m_" + name] = out["x_" + name] = np.zeros(
                    ncell, np.int64 if w is None else float
                )
                continue
            mh = mask & heads
            m = np.maximum(
                np.bincount(cs[mh], minlength=ncell), np.bincount(cd[mh], minlength=ncell)
            )
            wm = None if w is None else w[mask]
            x = np.maximum(np.bincount(cs[mask], wm, minlength=ncell),
                           np.bincount(cd[mask], wm, minlength=ncell))
            out["m_" + name], out["x_" + name] = m, x
        red = t.reduce[a:b]
        out["red"] = np.bincount(cd[red], None if w is None else w[red], minlength=ncell)
        yield r0, r1, {f: np.asarray(out[f]).reshape(r1 - r0, p) for f in FIELDS}
