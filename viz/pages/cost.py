"""Cost: the alpha-beta-gamma model of every all-reduce against message size, and measurements.

    dplab app                                            # then the Cost page
    dplab bench --world-sizes 2,4 --json bench.json      # a file this page loads

The curves are ``dplab.reference.costmodel.cost`` over the schedules the executor runs, the
crossovers are computed by ``dplab.viz.cost.crossovers`` (one sentence for coinciding curves,
``merged_crossovers``); measured rows come from a short ``dplab bench`` run now (the command
line's own runner, cached by its arguments) or from ``--json`` files, and alpha and beta are
fitted to them by ``dplab.viz.cost_fit``. This file only wires controls to those builders.
Controls live in the URL (deep links).
"""

from __future__ import annotations

from collections.abc import Callable

import streamlit as st

from dplab.backends.fastpath.arrays import ALLREDUCE as ARRAY_BUILDERS
from dplab.backends.runs.uploads import BENCH, bench_rows
from dplab.reference.algorithms import ALLREDUCE
from dplab.reference.costmodel import best_regions
from dplab.reference.errors import ConfigError, DplabError
from dplab.reference.topology import PRESETS
from dplab.viz.budget import BUDGET, visitor_hooks
from dplab.viz.cost import CostParams, busbw_line, format_bytes
from dplab.viz.cost_crossovers import coinciding, coinciding_sentence, merged_crossovers
from dplab.viz.cost_figure import cost_figure
from dplab.viz.cost_fit import fit_alpha_beta, fit_table, residual_figure, run_bench
from dplab.viz.cost_regions import REGION_SIZES, WORLD_SIZES, regions_figure
from dplab.viz.deep_links import MAX_PARAM_CHARS, adopt, url_list

# Shown until the learner picks others: the textbook's four and MPICH's two. All ten at once draw
# a dozen crossovers on top of each other; the multiselect offers every registered one.
FIRST_SHOWN = ("naive", "ring", "tree", "direct", "recursive_doubling", "rabenseifner")
ALPHA_US = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
BETA_GBPS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 12.5, 25.0, 50.0, 100.0, 200.0, 400.0)
GAMMA = ("free", "1", "2.5", "5", "10", "25", "50", "100")
SIZES = tuple(1 << k for k in range(2, 31))  # 4 B .. 1 GiB
BENCH_SIZES = (4096, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
Y = {"time": "time", "algbw": "algbw", "busbw": "busbw"}
SOURCES = {"none": "model only", "run": "run a short bench now (local)",
           "file": "load dplab bench --json files"}
FIT_BY = {"backend": "per backend", "algorithm": "per backend and algorithm"}


BENCH_WORLD_SIZES = tuple(range(2, 9))
BENCH_MAX_WORLDS, BENCH_MAX_SIZES = 3, 4
MAX_FILES = 8
# Every doubling of p costs ~4x and cannot be stopped midway: 1024 is ~10 s of one core, 4096
# minutes.
REGIONS_MAX_P = 1024  # a short bench: each world size is one more world of ranks


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _url_list(item: Callable[[str], object], pool: tuple, limit: int) -> Callable[[str], tuple]:
    """Each value once, only the offered ones, at most ``limit``:
    a URL of repeats is one control."""
    def parse(raw: str) -> tuple:
        value = url_list(raw, item, pool, limit)
        if value is None:
            raise ValueError(raw)
        return tuple(value)
    return parse


# key -> (default, parse from the URL, options it must be among or None);
# the URL's name drops "cost_"
CONTROLS = {
    "cost_world_size": (8, int, tuple(range(2, 17))),
    "cost_alpha_us": (5.0, float, ALPHA_US),
    "cost_beta_gbps": (10.0, float, BETA_GBPS),
    "cost_gamma": ("free", str, GAMMA),
    "cost_sizes": ((1 << 10, 256 << 20), _ints, None),
    "cost_y": ("time", str, tuple(Y)),
    "cost_algorithms": (FIRST_SHOWN, _url_list(str, tuple(ALLREDUCE), len(ALLREDUCE)), None),
    "cost_source": ("none", str, tuple(SOURCES)),
    "cost_fit_by": ("backend", str, tuple(FIT_BY)),
    "cost_bench_world_sizes": ((2,), _url_list(int, BENCH_WORLD_SIZES, BENCH_MAX_WORLDS), None),
    "cost_bench_sizes": (
        (4096, 1 << 16, 1 << 20),
        _url_list(int, BENCH_SIZES, BENCH_MAX_SIZES),
        None,
    ),
}


def _valid(key: str, value: object) -> bool:
    options = CONTROLS[key][2]
    if options is not None:
        return value in options
    if key == "cost_sizes":
        return len(value) == 2 and value[0] < value[1] and set(value) <= set(SIZES)
    return len(value) > 0  # the lists: already only offered values, each once (``_url_list``)


def from_url() -> None:
    """Seed each control from the URL once per session; a bad value falls back to the default.

    The size range is the exception: a range select_slider seeded through session state comes
    back as a single value under AppTest, so it gets its start as ``value=``
    (``_cost_sizes_start``).
    """
    for key, (default, parse, _) in CONTROLS.items():
        if key in st.session_state or (
            key == "cost_sizes" and "_cost_sizes_start" in st.session_state
        ):
            continue
        raw = st.query_params.get(key.removeprefix("cost_"))
        try:
            value = default if raw is None or len(raw) > MAX_PARAM_CHARS else parse(raw)
        except (ValueError, OverflowError):
            value = default
        value = value if _valid(key, value) else default
        st.session_state["_cost_sizes_start" if key == "cost_sizes" else key] = value


def to_url() -> None:
    def text(v: object) -> str:
        return ",".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
    st.query_params.update({k.removeprefix("cost_"): text(st.session_state[k]) for k in CONTROLS})


@st.cache_data(show_spinner=False, max_entries=16)
def short_bench(world_sizes: tuple[int, ...], sizes: tuple[int, ...]) -> list[dict]:
    """``dplab bench`` on freshly forked local ranks, a few tenths of a second per cell; cached.
    Each world waits its turn in the server's budget and dies with the page (``viz.budget``)."""
    stop, check = visitor_hooks()
    return run_bench(list(world_sizes), list(sizes), reps=3, target_seconds=0.05,
                     world=lambda p, backend: BUDGET.world(p, backend, stop=stop, check=check))


def model_controls() -> CostParams:
    c = st.columns(4)
    p = c[0].slider("world size p", 2, 16, key="cost_world_size")
    alpha = c[1].select_slider(
        "α: latency per message (µs, log scale)", ALPHA_US, key="cost_alpha_us"
    )
    beta = c[2].select_slider(
        "β: link bandwidth (GB/s; β = 1 / it)", BETA_GBPS, key="cost_beta_gbps"
    )
    gamma = c[3].select_slider("γ: reduction speed (GB/s)", GAMMA, key="cost_gamma",
                               help="free: the reduction costs nothing (the alpha-beta model)")
    c = st.columns([2, 1, 2])
    lo, hi = c[0].select_slider("message sizes", SIZES, value=st.session_state["_cost_sizes_start"],
                                key="cost_sizes", format_func=format_bytes)
    c[1].radio("y axis", tuple(Y), key="cost_y", horizontal=True)
    algorithms = c[2].multiselect("algorithms", tuple(ALLREDUCE), key="cost_algorithms")
    return CostParams(alpha_s=alpha * 1e-6, beta_gbps=beta,
                      gamma_gbps=None if gamma == "free" else float(gamma), world_size=p,
                      min_bytes=lo, max_bytes=hi, algorithms=tuple(algorithms))


def measured_rows() -> list[dict]:
    source = st.radio("measurements", tuple(SOURCES), key="cost_source", format_func=SOURCES.get,
                      horizontal=True)
    if source == "run":
        c = st.columns(2)
        ps = c[0].multiselect("bench world sizes", BENCH_WORLD_SIZES, key="cost_bench_world_sizes",
                              max_selections=BENCH_MAX_WORLDS)
        sizes = c[1].multiselect(
            "bench sizes",
            BENCH_SIZES,
            key="cost_bench_sizes",
            format_func=format_bytes,
            max_selections=BENCH_MAX_SIZES,
        )
        ps, sizes = sorted(set(ps))[:BENCH_MAX_WORLDS], sorted(set(sizes))[:BENCH_MAX_SIZES]
        if not ps or len(sizes) < 2:
            st.info("Pick a world size and at least two sizes: two unknowns need two sizes.")
            return []
        queued = st.empty()
        if line := BUDGET.waiting_line(max(ps)):
            queued.info(line)
        try:
            with st.spinner("dplab bench on the local backend, world sizes "
                            f"{', '.join(map(str, ps))} ..."):
                return short_bench(tuple(ps), tuple(sizes))
        except DplabError as e:
            st.error(str(e))
            return []
        finally:
            queued.empty()
    if source == "file":
        files = st.file_uploader(
            "dplab bench --json files", type=["json"], accept_multiple_files=True, key="cost_files"
        )
        rows: list[dict] = []
        if len(files or []) > MAX_FILES:
            st.warning(f"Fitting the first {MAX_FILES} of {len(files)} files: the fit is one per "
                       "backend.")
        for f in (files or [])[:MAX_FILES]:
            try:
                more = bench_rows(f.getvalue(), f.name)
                if len(rows) + len(more) > BENCH.max_rows:
                    raise ConfigError(f"{f.name} brings the rows past {BENCH.max_rows:,}, what "
                                      "this page fits at once: load fewer files")
                rows += more
            except DplabError as e:
                st.error(str(e))
        if not files:
            st.info("Write one with `dplab bench --world-sizes 2,4 --json bench.json`, then load "
                    "it here.")
        return rows
    return []


def show_fit(rows: list[dict], p: int) -> dict[tuple[str, str], tuple[float, float]]:
    """The fit's table, one line per fit, the residuals; returns the lines to draw at this p."""
    by = st.radio(
        "fit α and β", tuple(FIT_BY), key="cost_fit_by", format_func=FIT_BY.get, horizontal=True
    )
    fits = fit_alpha_beta(rows, per_algorithm=by == "algorithm")
    if not fits:
        st.info("No row to fit: native and memcpy rows have no schedule of ours.")
        return {}
    st.caption("Each row is one equation, time = a·α + b·β, with a (latencies) and b (bytes on the "
               "critical path) read off its schedule; least squares on relative error. γ is not "
               "separate: every algorithm reduces half the bytes it moves, so the fitted β holds "
               "γ/2.")
    for f in fit_table(fits):
        if f["alpha_us"] is None:
            st.caption(f"{f['backend']} ({f['algorithm']}): {f['note']}")
        else:
            st.caption(
                f"fit {f['backend']} ({f['algorithm']}, {f['rows']} rows): "
                f"α = {f['alpha_us']:.3g} µs, "
                f"β = {f['beta_gbps']:.3g} GB/s, residuals rms {f['rms_residual_pct']:.2g}%, "
                f"max {f['max_residual_pct']:.2g}%" + (f" ({f['note']})" if f["note"] else "")
            )
    st.dataframe(fit_table(fits), key="cost_fit_table", hide_index=True)
    st.plotly_chart(residual_figure(fits), key="cost_residuals")
    lines = {}
    for f in fits:
        if f.alpha_s is not None:
            for alg in {r["algorithm"] for r in f.rows}:
                lines[(f.backend, alg)] = (f.alpha_s, f.beta)
    return lines


st.title("Cost: α, β, γ against message size")
adopt(st.query_params, "cost")  # a lesson's ?p=8&algorithm=ring: world_size, algorithms
from_url()
try:
    params = model_controls()
except DplabError as e:
    st.error(str(e))
    st.stop()
xs = merged_crossovers(params)
if xs:
    for i, x in enumerate(xs, 1):
        # numbered as the figure's markers: names overlap where they bunch up
        st.caption(f"Crossover {i}: {x.sentence()}.")
else:
    st.caption(f"No crossover between {', '.join(params.algorithms)} from "
               f"{format_bytes(params.min_bytes)} to {format_bytes(params.max_bytes)} at "
               f"p={params.world_size}.")
same = coinciding_sentence(coinciding(params), params.world_size)
if same:
    st.caption(same)
figure_slot = st.container()
st.caption(busbw_line(params.world_size))
st.subheader("Measured")
rows = measured_rows()
fitted = show_fit(rows, params.world_size) if rows else {}
at_p = [r for r in rows if r["world_size"] == params.world_size]
if rows and not at_p:
    have = sorted({r["world_size"] for r in rows})
    st.caption(f"The rows are at p = {', '.join(map(str, have))}: set the world size to one of "
               "them to see them next to the model.")
with figure_slot:
    st.plotly_chart(cost_figure(params, st.session_state["cost_y"], measured=rows, fitted=fitted),
                    key="cost_figure")


@st.cache_data(show_spinner="pricing every schedule at every world size ...", max_entries=32)
def _regions(preset: str, max_p: int):  # noqa: ANN202 - a cached Regions
    return best_regions(PRESETS[preset], [p for p in WORLD_SIZES if p <= max_p], REGION_SIZES,
                        builders=ARRAY_BUILDERS)  # the array builders: same rows


st.subheader("Which all-reduce wins where")
if st.toggle(
    "Map the cheapest schedule per (world size, message size) on a cluster", key="regions_on"
):
    preset = st.selectbox("topology", list(PRESETS), key="regions_topology")
    max_p = st.select_slider(
        "largest world size",
        [p for p in WORLD_SIZES[2:] if p <= REGIONS_MAX_P],
        value=64,
        key="regions_max_p",
        help=f"every schedule is built and priced at each p: {REGIONS_MAX_P} takes ~10 s",
    )
    st.caption(PRESETS[preset].source)
    st.plotly_chart(regions_figure(_regions(preset, max_p)), key="cost_regions")
to_url()
