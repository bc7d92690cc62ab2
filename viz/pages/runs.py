"""Runs: the timeline of a real training run, made now on the local backend or loaded from a file.

    dplab app                                   # then the Runs page
    dplab train --world-size 4 --trace run.json # a trace file this page loads

A run goes through ``dplab.backends.runs.run.run_train`` (what ``dplab train`` calls), cached by
its configuration. Every bar is a recorded span and every number under the picture is computed
from those spans by ``dplab.viz.timeline_metrics``. Controls live in the URL (deep links).
"""

from __future__ import annotations

import streamlit as st

from dplab.backends.runs.run import MODES, RunSpec, run_train
from dplab.reference.algorithms import ALGORITHMS
from dplab.reference.errors import DplabError
from dplab.reference.model import MLPConfig
from dplab.reference.trace import Event, merge
from dplab.reference.train.single import TrainConfig
from dplab.viz.budget import BUDGET, cores, visitor_hooks
from dplab.viz.deep_links import adopt
from dplab.viz.timeline import chrome_bytes, load_trace, timeline_figure, trace_bytes
from dplab.viz.timeline_metrics import configured_stragglers, find_straggler, rank_stats, totals

SOURCES = {"run": "Make a run now (local backend)", "file": "Load a trace file"}
BUCKETS_MB = (0.0005, 0.002, 0.01, 0.1, 25.0)
HIDDEN = (16, 64, 256, 512)
STALENESS = ("0", "1", "2", "4", "inf")
FACTORS = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
# key -> (default, parse from the URL); the URL's parameter is the key without "runs_"
CONTROLS = {
    "runs_source": ("run", str), "runs_world_size": (4, int), "runs_mode": ("sync", str),
    "runs_algorithm": ("ring", str), "runs_bucket_mb": (0.0005, float), "runs_hidden": (16, int),
    "runs_steps": (10, int), "runs_staleness": ("1", str), "runs_backup": (1, int),
    "runs_straggler": ("none", str), "runs_factor": (4.0, float),
    "runs_detail": (False, lambda v: v == "True"),
}

BOUNDS = {"runs_world_size": (1, 8), "runs_steps": (1, 50), "runs_backup": (0, 7)}


def from_url() -> None:
    """Seed each control from the URL once per session (a bad value falls back to the default)."""
    for key, (default, parse) in CONTROLS.items():
        if key not in st.session_state:
            raw = st.query_params.get(key.removeprefix("runs_"))
            try:
                st.session_state[key] = default if raw is None else parse(raw)
            except (ValueError, OverflowError):
                st.session_state[key] = default
    for key, (lo, hi) in BOUNDS.items():
        # a number the inputs do not offer: the default, not their edge
        if not lo <= st.session_state[key] <= hi:
            st.session_state[key] = CONTROLS[key][0]


def keep(key: str, options: tuple) -> None:
    """A value from the URL that is not among the options becomes the default."""
    if st.session_state[key] not in options:
        st.session_state[key] = CONTROLS[key][0] if CONTROLS[key][0] in options else options[0]


def to_url() -> None:
    st.query_params.update({k.removeprefix("runs_"): str(st.session_state[k]) for k in CONTROLS})


# The largest run (8 ranks, 50 steps, hidden 512, a bucket per layer) is ~5 MB pickled:
# ~80 MB in all.
@st.cache_data(show_spinner=False, max_entries=16)
def make_run(world_size: int, mode: str, algorithm: str, bucket_mb: float, hidden: int, steps: int,
             staleness: int | None, backup: int, straggler: tuple) -> tuple[dict, list[Event]]:
    """One real run, traced, on freshly forked local ranks; cached by every argument. The ranks wait
    their turn in the server's budget and die with the page (``viz.budget``)."""
    spec = RunSpec(world_size=world_size, mode=mode, algorithm=algorithm, bucket_cap_mb=bucket_mb,
                   staleness=staleness, backup_workers=backup, straggler=straggler,
                   train=TrainConfig(model=MLPConfig(hidden=(hidden, hidden)), steps=steps))
    spec.validate()  # a refused configuration starts no ranks
    stop, check = visitor_hooks()
    # as run_train's launch
    workers = frozenset(range(1, world_size)) if mode == "async" else frozenset()
    with BUDGET.world(world_size, tolerate=workers, stop=stop, check=check) as world:
        row, per_rank = run_train(spec, world, trace=True)
    return row, merge(per_rank)


def run_controls() -> tuple[dict, list[Event]] | None:
    c = st.columns(4)
    p = c[0].number_input("world size", *BOUNDS["runs_world_size"], step=1, key="runs_world_size")
    keep("runs_mode", MODES)
    mode = c[1].selectbox("mode", MODES, key="runs_mode",
                          help="sync: all-reduce of gradient buckets; async: a parameter server "
                               "with bounded staleness; backup: sync through the server, dropping "
                               "the slowest")
    steps = c[2].number_input(
        "steps (clocks in async)", *BOUNDS["runs_steps"], step=1, key="runs_steps"
    )
    keep("runs_hidden", HIDDEN)
    hidden = c[3].selectbox("hidden width (2 layers)", HIDDEN, key="runs_hidden",
                            help="a wider model computes longer, so more communication can hide "
                                 "behind it")
    c = st.columns(4)
    keep("runs_algorithm", ALGORITHMS)
    keep("runs_bucket_mb", BUCKETS_MB)
    keep("runs_staleness", STALENESS)
    algorithm = st.session_state["runs_algorithm"]
    bucket_mb = st.session_state["runs_bucket_mb"]
    staleness, backup = None, 1
    if mode == "sync":
        algorithm = c[0].selectbox("all-reduce algorithm", ALGORITHMS, key="runs_algorithm")
        bucket_mb = c[1].select_slider("bucket size (MiB)", BUCKETS_MB, key="runs_bucket_mb",
                                       help="0.0005 MiB: a bucket per layer; 25 MiB: one, after "
                                            "backward")
    elif mode == "async":
        s = c[0].selectbox("staleness (clocks)", STALENESS, key="runs_staleness")
        staleness = None if s == "inf" else int(s)
    else:
        backup = c[0].number_input(
            "backup workers", *BOUNDS["runs_backup"], step=1, key="runs_backup"
        )
    ranks = ("none", *(str(r) for r in range(int(p))))
    keep("runs_straggler", ranks)
    keep("runs_factor", FACTORS)
    who = c[2].selectbox("straggler rank", ranks, key="runs_straggler")
    factor = c[3].select_slider("straggler factor", FACTORS, key="runs_factor",
                                help="its compute is stretched this many times (it sleeps the "
                                     "difference)")
    straggler = () if who == "none" else ((int(who), float(factor)),)
    queued = st.empty()
    if line := BUDGET.waiting_line(int(p)):
        queued.info(line)
    with st.spinner(f"training on {p} local ranks ..."):
        try:
            return make_run(
                int(p),
                mode,
                algorithm,
                float(bucket_mb),
                int(hidden),
                int(steps),
                staleness,
                int(backup),
                straggler,
            )
        except DplabError as e:
            st.error(str(e))
            return None
        finally:
            queued.empty()


def file_controls() -> tuple[dict, list[Event]] | None:
    up = st.file_uploader(
        "trace file (JSON from `dplab train --trace PATH`)", type=["json"], key="runs_file"
    )
    if up is None:
        st.info("Write one with `dplab train --world-size 4 --trace run.json`, then load run.json "
                "here.")
        return None
    try:
        events, meta = load_trace(up.getvalue())
    except DplabError as e:
        st.error(str(e))
        return None
    return meta.get("row", {}), events


def show(row: dict, events: list[Event], made_here: bool = False) -> None:
    """The numbers, the timeline and the table of one run. ``made_here``:
    this machine ran it just now, so its cores are the ones the ranks shared."""
    stats = rank_stats(events)
    total = totals(stats)
    straggler = find_straggler(stats, configured=configured_stragglers(row),
                               cores=cores() if made_here else None)
    n = total["ranks"]
    per_rank = f"mean of {n} rank{'s' if n != 1 else ''}"

    def summed(what: str, key: str) -> str:
        return (
            f"{what}, per rank: the mean over the {n} ranks (summed over them: {total[key]:.1f} ms)"
        )

    c = st.columns(6)
    c[0].metric("wall", f"{total['wall_ms']:.1f} ms", delta="first to last span", delta_color="off",
                delta_arrow="off", help="the first span's start to the last span's end, any rank")
    c[1].metric(
        "communication",
        f"{total['comm_mean_ms']:.1f} ms",
        delta=per_rank,
        delta_color="off",
        delta_arrow="off",
        help=summed("collectives and transfers", "comm_ms"),
    )
    c[2].metric("comm. hidden", f"{total['overlap_pct']:.1f} %", delta="over all ranks",
                delta_color="off", delta_arrow="off",
                help="the share of all ranks' communication time that ran while the same rank "
                     "computed")
    c[3].metric("exposed comm.", f"{total['exposed_comm_mean_ms']:.1f} ms", delta=per_rank,
                delta_color="off", delta_arrow="off",
                help=summed("communication with no compute under it", "exposed_comm_ms"))
    c[4].metric("waiting", f"{total['wait_mean_ms']:.1f} ms", delta=per_rank, delta_color="off",
                delta_arrow="off", help=summed("wait spans", "wait_ms"))
    c[5].metric("straggler", "none" if straggler.rank is None else f"rank {straggler.rank}",
                delta={True: "configured", False: "not configured"}.get(straggler.configured),
                delta_color="off", delta_arrow="off")
    st.caption(straggler.sentence, help="compute: forward, backward, optimizer (async: compute, "
                                        "apply)")
    if row.get("clock") == "simulated":
        about = row.get("cluster_about") or row.get("cluster")
        st.caption(f"Simulated time on {about}: every span is the cluster's model (dplab train "
                   "--backend sim), not this machine's clock.")
    if row:
        facts = [f"{k} {row[k]:.4g}" if isinstance(row[k], float) else f"{k} {row[k]}"
                 for k in ("mode", "algorithm", "world_size", "steps", "straggler", "final_loss",
                           "max_abs_diff_vs_single", "replay_exact") if k in row]
        st.caption("the run: " + ", ".join(facts))
    st.toggle("every send and receive (nested spans)", key="runs_detail")
    st.plotly_chart(timeline_figure(events, detail=st.session_state["runs_detail"]),
                    key="runs_timeline", width="stretch")
    st.dataframe(
        [
            {k: round(v, 3) if isinstance(v, float) else v for k, v in s.row().items()}
            for s in stats
        ],
        hide_index=True,
        key="runs_table",
    )
    c = st.columns(2)
    chrome = chrome_bytes(events, row.get("cluster", ""))  # a simulated run's says so
    c[0].download_button("Chrome trace (open in ui.perfetto.dev)", chrome,
                         file_name="run.chrome.json", mime="application/json", key="runs_chrome")
    c[1].download_button("dplab trace (load it here again)", trace_bytes(events, {"row": row}),
                         file_name="run.json", mime="application/json", key="runs_trace")


st.title("Runs")
st.caption("The timeline of a real run: one lane per rank and thread, every bar a span the "
           "trainers recorded while they ran. The numbers are computed from the same spans.")
adopt(st.query_params, "runs")  # a lesson's ?p=4: world_size
from_url()
keep("runs_source", tuple(SOURCES))
source = st.radio(
    "source", tuple(SOURCES), format_func=SOURCES.get, key="runs_source", horizontal=True
)
result = run_controls() if source == "run" else file_controls()
to_url()
if result is not None:
    show(*result, made_here=source == "run")
