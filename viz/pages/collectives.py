"""Collectives: watch a schedule run, round by round, from the simulator's provenance.

    dplab app      # then Collectives; or a deep link such as
    http://127.0.0.1:8501/collectives?coll_collective=allreduce&coll_algorithm=tree&coll_p=6&coll_round=2

Controls are bound to the URL's query parameters (``bind="query-params"``; the round is kept
there by hand), so a link shows the same picture. First / Prev / Next / Last move the server's
round (the caption and metrics follow); Play and the slider animate in the browser.
"""

from __future__ import annotations

import streamlit as st

from dplab.viz.collectives import (
    COLLECTIVES,
    CollectiveConfig,
    Walkthrough,
    algorithms_for,
    walkthrough,
)
from dplab.viz.collectives_figure import at_frame, figure_spec
from dplab.viz.deep_links import adopt

BIND = "query-params"
ROUND = "coll_round"
WRITTEN = "_coll_round_in_url"  # the round this page last put in the URL


# An entry is at most ~10 MB pickled (p=16 pipelined_ring, whatever n: long vectors carry no
# values), so the cache holds at most ~160 MB however many distinct URLs visitors open.
@st.cache_data(show_spinner=False, max_entries=16)
def _build(cfg: CollectiveConfig) -> tuple[Walkthrough, dict]:
    """A walkthrough and its animation, per configuration (the p=16 ring: 0.3 s uncached)."""
    w = walkthrough(cfg)
    return w, figure_spec(w)


def _fix_state(key: str, options: list) -> None:
    """A value the options no longer hold (another collective, a smaller p) is forgotten before the
    widget is drawn, so the widget starts again from its default."""
    if key in st.session_state and st.session_state[key] not in options:
        del st.session_state[key]


def _round_from_url() -> None:
    """The URL's round, unless this page wrote it there itself on its last run: a link into the page
    (a lesson's, later in the same session) opens at its round, or at 0 when it names none."""
    raw = st.query_params.get(ROUND)
    if ROUND in st.session_state and raw is not None and raw == st.session_state.get(WRITTEN):
        return
    try:
        st.session_state[ROUND] = max(0, int(raw or 0))
    except ValueError:
        st.session_state[ROUND] = 0


def _go(target: int) -> None:
    st.session_state[ROUND] = max(0, target)


def _controls() -> tuple[CollectiveConfig, str]:
    side = st.sidebar
    collective = side.selectbox("collective", list(COLLECTIVES), format_func=COLLECTIVES.get,
                                key="coll_collective", bind=BIND)
    algorithms = algorithms_for(collective)
    _fix_state("coll_algorithm", algorithms)
    preferred = next(a for a in ("ring", "tree", *algorithms) if a in algorithms)
    algorithm = side.selectbox(
        "algorithm", algorithms, algorithms.index(preferred), key="coll_algorithm", bind=BIND
    )
    others = ["none", *[a for a in algorithms if a != algorithm]]
    _fix_state("coll_vs", others)
    vs = side.selectbox("side by side with", others, key="coll_vs", bind=BIND,
                        help="a second algorithm at the same p and n, on the same round")
    p = side.slider("world size p", 1, 16, 4, key="coll_p", bind=BIND)
    n = side.number_input("vector length n (float32 elements)", 0, 1 << 30, 8, step=1, key="coll_n",
                          bind=BIND,
                          help="up to 256 elements, each cell's real values show on hover")
    rooted = collective in ("broadcast", "reduce")
    _fix_state("coll_root", list(range(p)))
    root = side.number_input(
        "root",
        0,
        max(p - 1, 0),
        0,
        key="coll_root",
        bind=BIND,
        disabled=not rooted,
        help="broadcast and reduce only",
    )
    side.markdown("**cost model** (α-β-γ)")
    alpha = side.number_input(
        "α: latency per message (µs)", 0.001, 1e6, 5.0, key="coll_alpha_us", bind=BIND
    )
    beta = side.number_input(
        "β as link bandwidth (GB/s)", 0.001, 1e6, 10.0, key="coll_beta_gbps", bind=BIND
    )
    gamma = side.number_input(
        "γ as reduction bandwidth (GB/s)", 0.001, 1e6, 20.0, key="coll_gamma_gbps", bind=BIND
    )
    cfg = CollectiveConfig(
        collective,
        algorithm,
        int(p),
        int(n),
        float(alpha),
        float(beta),
        float(gamma),
        int(root) if rooted else 0,
    )
    return cfg, vs


def _metrics(w: Walkthrough, k: int) -> None:
    f = w.frames[min(k, len(w.frames) - 1)]
    busiest = max(f.bytes_sent)
    a, b, c = st.columns(3)
    a.metric("rounds done", f"{f.index} of {w.rounds}")
    form = (
        "no closed form"
        if w.closed_form_bytes is None
        else f"closed form {w.closed_form_bytes:,} B"
    )
    b.metric("bytes sent, busiest rank", f"{busiest:,} B",
             help="the walk of the schedule's rounds so far", delta=form, delta_color="off",
             delta_arrow="off")
    cf = "" if w.closed_form_time_s is None else f"closed form {w.closed_form_time_s * 1e6:,.2f} µs"
    c.metric(
        "cost-model time so far",
        f"{f.time_s * 1e6:,.2f} µs",
        delta=cf or None,
        delta_color="off",
        delta_arrow="off",
        help="dplab.reference.costmodel.cost over the rounds so far",
    )


def _panel(w: Walkthrough, spec: dict, k: int, key: str) -> None:
    f = w.frames[min(k, len(w.frames) - 1)]
    st.caption(f.sentence)
    _metrics(w, k)
    st.plotly_chart(at_frame(spec, k), key=key, config={"displayModeBar": False})
    rows = [{"rank": r, "bytes sent so far": sent} for r, sent in enumerate(f.bytes_sent)]
    with st.expander(f"this round's {len(f.transfers)} transfers, and bytes sent per rank"):
        st.dataframe([{"src": t.src, "dst": t.dst, "chunk": t.chunk, "op": "add" if t.op == "reduce"
                       else "copy"} for t in f.transfers], hide_index=True)
        st.dataframe(rows, hide_index=True)


st.title("Collectives")
st.markdown("A collective is a **schedule**: chunks of the buffer and rounds of transfers. This is "
            "the very schedule the executor runs on every backend, played through the simulator. "
            "Each cell is one rank's chunk: its colour counts how many ranks' contributions it "
            "holds, its label says which (✓: what the collective leaves there); arrows are the "
            "round's transfers (orange adds, blue copies).")
# ?algorithm=tree&p=6 (a lesson's link): the widgets read coll_algorithm, coll_p
if adopt(st.query_params, "collectives"):
    st.switch_page("pages/collectives.py", query_params=st.query_params.to_dict())
_round_from_url()
cfg, vs = _controls()
w, spec = _build(cfg)
second = _build(CollectiveConfig(**{**cfg.__dict__, "algorithm": vs})) if vs != "none" else None
last = max(w.rounds, second[0].rounds if second else 0)
st.session_state[ROUND] = min(st.session_state[ROUND], last)
buttons = st.columns([1, 1, 1, 1, 6])
buttons[0].button("First", key="coll_first", on_click=_go, args=(0,))
buttons[1].button("◀ Prev", key="coll_prev", on_click=_go, args=(st.session_state[ROUND] - 1,))
buttons[2].button(
    "Next ▶", key="coll_next", on_click=_go, args=(min(st.session_state[ROUND] + 1, last),)
)
buttons[3].button("Last", key="coll_last", on_click=_go, args=(last,))
k = st.session_state[ROUND]
st.query_params[ROUND] = st.session_state[WRITTEN] = str(k)
if second is None:
    _panel(w, spec, k, "coll_fig")
else:
    left, right = st.columns(2)
    with left:
        _panel(w, spec, k, "coll_fig")
    with right:
        _panel(*second, k, "coll_fig_vs")
st.caption(
    "The buttons move the round here (caption, counters, table); ▶ Play and the slider "
    "animate in your browser. The figure's title carries the counters of the frame it shows."
)
