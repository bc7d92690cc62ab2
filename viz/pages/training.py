"""Training: sync vs backup workers vs a staleness grid, with and without a straggler, from real
runs.

    dplab app                      # then the Training page
    dplab compare --modes sync,async,backup --world-sizes 4 --staleness-grid 0,2,inf --steps 20
                                   # the same grid's rows on the command line (one setting
                                   # of straggler)

The runs go through ``dplab compare``'s own functions (``compare_specs``, ``run_train``) on the
local backend (times measured here) or on a simulated cluster (``--backend sim``: the same runs,
their time the cluster's), cached by their configuration (``dplab.viz.training_runs``); the figures
are ``dplab.viz.training``'s. Controls live in the URL (deep links).
"""

from __future__ import annotations

from collections.abc import Callable

import streamlit as st

from dplab.backends.runs.run import straggler_label
from dplab.reference.cluster import CLUSTERS, cluster
from dplab.reference.errors import DplabError
from dplab.viz.budget import BUDGET, visitor_hooks
from dplab.viz.deep_links import MAX_PARAM_CHARS, adopt, url_list
from dplab.viz.training import (
    RELATIVE_TOL,
    X_NOTES,
    delay_counts,
    delay_figure,
    equivalence_figure,
    loss_figure,
    short_label,
    straggler_cost,
    summary_rows,
    throughput_figure,
    tolerance,
)
from dplab.viz.training_runs import Cell, TrainingGrid, fill_sync, run_cell, sync_steps

STALENESS = ("0", "1", "2", "4", "inf")
FACTORS = (1.0, 2.0, 4.0, 8.0, 16.0)
HIDDEN = (32, 128, 256)
HERE = "here (local backend, measured)"
MACHINES = (HERE, *CLUSTERS)  # the local backend, or a simulated cluster (the sim backend)


BOUNDS = {"training_world_size": (3, 6), "training_steps": (2, 50)}
BACKUP = tuple(range(1, BOUNDS["training_world_size"][1] - 1))  # b < W = p - 1 workers


def _url_list(item: Callable[[str], object], pool: tuple) -> Callable[[str], list]:
    """Each offered value once: a URL of repeats asks for one run per value, not one per repeat."""
    def parse(raw: str) -> list:
        value = url_list(raw, item, pool, len(pool))
        if value is None:
            raise ValueError(raw)
        return value
    return parse


# key -> (default, parse from the URL); the URL's parameter is the key without "training_"
CONTROLS = {
    "training_world_size": (4, int), "training_steps": (20, int),
    "training_staleness": (["0", "2", "inf"], _url_list(str, STALENESS)),
    "training_backup": ([1], _url_list(int, BACKUP)),
    "training_factor": (8.0, float), "training_hidden": (128, int),
    "training_cluster": (HERE, str),
}


def from_url() -> None:
    """Seed each control from the URL once per session (a bad value falls back to the default)."""
    for key, (default, parse) in CONTROLS.items():
        if key not in st.session_state:
            raw = st.query_params.get(key.removeprefix("training_"))
            try:
                st.session_state[key] = (
                    default if raw is None or len(raw) > MAX_PARAM_CHARS else parse(raw)
                )
            except (ValueError, OverflowError):
                st.session_state[key] = default
    for key, (lo, hi) in BOUNDS.items():  # a number input refuses a value outside its range
        if not lo <= st.session_state[key] <= hi:
            st.session_state[key] = CONTROLS[key][0]


def to_url() -> None:
    def text(v: object) -> str:
        return ",".join(str(x) for x in v) if isinstance(v, list) else str(v)

    st.query_params.update(
        {k.removeprefix("training_"): text(st.session_state[k]) for k in CONTROLS}
    )


Args = tuple  # (world_size, steps, staleness, backup, factor, hidden, cluster): the cache's key


def grid_of(args: Args) -> TrainingGrid:
    p, steps, staleness, backup, factor, hidden, where = args
    return TrainingGrid(world_size=p, steps=steps, staleness=staleness, backup_workers=backup,
                        straggler_factor=factor, hidden=(hidden,),
                        cluster=None if where == HERE else where)


# A cell is at most ~0.3 MB pickled (p=6, 50 steps, hidden 256), the per-step parameters ~2 MB.
@st.cache_data(show_spinner=False, max_entries=128)
def make_cell(args: Args, index: int) -> Cell:
    """Cell ``index`` of the grid: one real run on freshly forked local ranks, cached. The ranks
    wait their turn in the server's budget and die with the page (``viz.budget``)."""
    grid = grid_of(args)
    stop, check = visitor_hooks()
    with BUDGET.world(grid.world_size, grid.backend, stop=stop, check=check,
                      cluster=grid.cluster) as world:
        return run_cell(grid.specs()[index], world, grid.points)


@st.cache_data(show_spinner=False, max_entries=16)
def make_sync_steps(args: Args) -> list:
    """The sync spec's per-step parameters (one more run, checkpointing every step), cached."""
    spec = next(s for s in grid_of(args).specs() if s.mode == "sync")
    stop, check = visitor_hooks()
    with BUDGET.world(spec.world_size, spec.backend, stop=stop, check=check,
                      cluster=spec.cluster) as world:
        return sync_steps(spec, world)


def make_runs(args: Args) -> list[Cell]:
    """Every cell, one cached run at a time, so the progress bar moves outside the cache."""
    grid, bar, queued = grid_of(args), st.empty(), st.empty()
    specs = grid.specs()
    if line := BUDGET.waiting_line(grid.world_size):
        queued.info(line)
    cells = []
    for i, spec in enumerate(specs):
        bar.progress(i / (len(specs) + 1), f"{i}/{len(specs) + 1}: {spec.label()}, straggler "
                                          f"{straggler_label(spec.straggler)}")
        cells.append(make_cell(args, i))
    bar.progress(len(specs) / (len(specs) + 1), "per-step equivalence of the sync runs")
    sync = [c for c in cells if c.row["mode"] == "sync"]
    if sync:
        fill_sync(sync, make_sync_steps(args), grid.train_config())
    bar.empty()
    queued.empty()
    return cells


def controls() -> TrainingGrid:
    if st.session_state["training_cluster"] not in MACHINES:
        st.session_state["training_cluster"] = HERE
    where = st.selectbox("where the ranks run", MACHINES, key="training_cluster",
                         help="here: the local backend, times measured here (with its load); a "
                              "cluster: the same runs on the sim backend, their time that "
                              "cluster's (simulated, deterministic)")
    c = st.columns(6)
    p = c[0].number_input(
        "world size",
        *BOUNDS["training_world_size"],
        step=1,
        key="training_world_size",
        help="sync: p ranks all-reduce; parameter server: rank 0 serves, p - 1 work",
    )
    steps = c[1].number_input("steps (clocks per worker)", *BOUNDS["training_steps"], step=1,
                              key="training_steps")
    state = st.session_state
    state["training_staleness"] = [
        s for s in dict.fromkeys(state["training_staleness"]) if s in STALENESS
    ]
    stal = c[2].multiselect("staleness grid (clocks)", STALENESS, key="training_staleness",
                            help="SSP's bound: how many clocks a worker may run ahead of the "
                                 "slowest")
    options = list(range(1, p - 1))
    st.session_state["training_backup"] = [
        b for b in dict.fromkeys(st.session_state["training_backup"]) if b in options
    ]
    backup = c[3].multiselect("backup workers b", options, key="training_backup",
                              help="synchronous SGD through the server: each step from the first "
                                   "W - b gradients")
    if st.session_state["training_factor"] not in FACTORS:
        st.session_state["training_factor"] = CONTROLS["training_factor"][0]
    factor = c[4].selectbox("straggler factor", FACTORS, key="training_factor",
                            help=f"rank {p - 1} computes this many times slower in the straggler's "
                                 "runs")
    if st.session_state["training_hidden"] not in HIDDEN:
        st.session_state["training_hidden"] = CONTROLS["training_hidden"][0]
    hidden = c[5].selectbox("hidden width", HIDDEN, key="training_hidden",
                            help="wider: more compute per step, which is what a straggler slows")
    to_url()
    return TrainingGrid(world_size=int(p), steps=int(steps),
                        staleness=tuple(None if s == "inf" else int(s) for s in stal),
                        backup_workers=tuple(backup), straggler_factor=float(factor),
                        hidden=(int(hidden),), cluster=None if where == HERE else where)


def show(cells: list[Cell], grid: TrainingGrid) -> None:
    sync = [c for c in cells if c.row["mode"] == "sync"]
    ps = [c for c in cells if c.row["mode"] != "sync"]
    cost = straggler_cost(cells)
    where = ("on the local backend" if grid.cluster is None else
             f"on the sim backend, in simulated time on {cluster(grid.cluster).describe()}")
    st.caption(f"{len(cells)} real runs of dplab compare's grid {where}: sync on "
               f"{grid.world_size} ranks, the parameter server with 1 server + "
               f"{grid.world_size - 1} workers; "
               f"each without and with rank {grid.world_size - 1} {grid.straggler_factor:g}x "
               "slower.")
    if cost:
        st.caption(f"Throughput with rank {grid.world_size - 1} {grid.straggler_factor:g}x slower, "
                   "over throughput without (1.00x: unharmed; below 1: the straggler costs that "
                   "much). ring: sync all-reduce; backup b: the server steps on the first W - b "
                   "gradients; s: the server's staleness bound.")
    m = st.columns(max(1, len(cost)))
    for col, (label, ratio) in zip(m, cost.items()):
        col.metric(short_label(label), f"{ratio:.2f}x",
                   help=f"{label}: samples/s with the straggler over samples/s without")
    if grid.cluster is None:
        st.caption("Measured, not modelled: a straggler costs sync its factor only where "
                   "compute dominates a step, and with fewer cores than ranks a sleeping straggler "
                   "hands its core to the others.")
    else:
        st.caption("Simulated, not measured: every time is the cluster's model (its devices' "
                   "FLOP/s, its links' alpha and beta), the same on every run of the page; the "
                   "losses and parameters are the real runs'.")
    left, right = st.columns(2)
    left.plotly_chart(loss_figure(cells, "step"), key="training_loss_steps")
    right.plotly_chart(loss_figure(cells, "time"), key="training_loss_time")
    clock = "wall time" if grid.cluster is None else f"simulated time on {grid.cluster}"
    st.caption("Left, steps: " + X_NOTES["step"] + f". Right, {clock}: " + X_NOTES["time"] + ". "
               "Every point's loss is evaluated on the whole data set: the last one is the row's "
               "final_loss.")
    st.plotly_chart(throughput_figure(cells), key="training_throughput")
    if ps:
        st.plotly_chart(delay_figure(cells), key="training_delays")
        worst = max(ps, key=lambda c: max(delay_counts(c), default=0))
        st.caption(f"Largest delay: {worst.row['max_delay']} updates ({worst.label}, straggler "
                   f"{worst.straggler}). Delay counts UPDATES between a gradient's pull and its "
                   "apply; staleness bounds CLOCKS, so with W workers and staleness s, "
                   "delay <= (W - 1)(2s + 1).")
    if sync:
        st.plotly_chart(equivalence_figure(cells), key="training_equivalence")
        diffs = sync[0].diffs
        zeros = sum(d == 0 for d in diffs)
        st.caption("Per step k: max |params_k − train_single(steps=k).params|, largest "
                   f"{max(diffs):.2e} over {len(diffs)} steps"
                   + (f" ({zeros} exactly 0, not drawn on the log axis)" if zeros else "")
                   + f", against the tolerance {tolerance(cells):.0e} (dashed: relative "
                     f"{RELATIVE_TOL:.0e}, "
                   "times max(1, max |params|)): rounding, not drift. "
                   "The per-step parameters are the checkpoints of one more run "
                   "of the same spec (a checkpoint after every step); its last equals each timed "
                   "sync run's final parameters bit for bit, straggler or not.")
    st.dataframe(summary_rows(cells), key="training_table")


st.title("Training: sync, backup workers, bounded staleness")
adopt(st.query_params, "training")  # a lesson's ?world_sizes=4 or ?p=4: world_size
from_url()
grid = controls()
try:
    grid.specs()  # bad combinations fail here, in one line, before any run
    with st.spinner(f"training the grid (real runs on the {grid.backend} backend)..."):
        cells = make_runs((grid.world_size, grid.steps, grid.staleness, grid.backup_workers,
                           grid.straggler_factor, grid.hidden[0], grid.cluster or HERE))
except DplabError as e:
    st.error(str(e))
else:
    show(cells, grid)
