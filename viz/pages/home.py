"""Home: what the app shows, with a link to each page the app has.

A page gets its link here once ``viz/app.py`` lists it; one still being written is left out
(its link would have nowhere to go). The pages from above viz/ (the Lessons page) come first,
with the sentence their entry point gives (``dplab.viz.added_pages``).
"""

from __future__ import annotations

import streamlit as st
from streamlit.errors import StreamlitPageNotFoundError

from dplab.viz.added_pages import added_pages

# (file under viz/pages/, link text, what it shows)
LINKS = [
    ("pages/collectives.py", "Collectives",
     "watch all-reduce, reduce-scatter, all-gather, broadcast and reduce move round by round: a "
     "rank x chunk grid labelled with whose contributions each cell holds, the round's transfers "
     "as arrows, bytes and cost-model time as counters, two algorithms side by side."),
    ("pages/runs.py", "Runs",
     "the timeline of a real training run, one lane per rank: compute, each bucket's all-reduce, "
     "waits, and how much communication the backward pass hid."),
    ("pages/cost.py", "Cost",
     "the alpha-beta-gamma cost of every algorithm against message size, crossovers named, and "
     "measured dplab bench rows fitted."),
    ("pages/training.py", "Training",
     "sync, async and backup workers, with and without a straggler: loss against steps and against "
     "wall time, from real dplab compare runs."),
]

st.title("dplab: Data-Parallel Lab")
st.markdown(
    "Data-parallel training written by hand, shown from the code that runs it. Nothing here is "
    "drawn by hand: every grid, arrow, timeline and curve is computed from the same schedule the "
    "executor runs, the simulator's provenance, the cost model, or real runs and benchmarks."
)
for page, label, blurb in [*((str(p.file), p.title, p.blurb) for p in added_pages()), *LINKS]:
    try:
        st.page_link(page, label=label)
    except StreamlitPageNotFoundError:  # not in app.py's PAGES yet
        continue
    st.caption(blurb)
st.caption("Start it with `dplab app`; every page keeps its controls in the URL, so a link shows "
           "the same picture.")
