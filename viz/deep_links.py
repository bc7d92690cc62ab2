"""Deep links between the app's pages: which URL parameters each page reads, and their short names.

    http://127.0.0.1:8501/collectives?algorithm=tree&p=6&n=12    # short names a lesson writes
    http://127.0.0.1:8501/collectives?coll_algorithm=tree&coll_p=6&coll_n=12   # what the page keeps

A lesson's step links to the page that explores it (``dplab.lessons.step.Explore``) with its own
parameters, in words a learner reads (``p``, ``algorithm``, ``world_sizes``). Each page keeps its
controls in the URL under its own names; ``adopt`` rewrites the short names into those before the
page draws its controls, so both spellings open the same picture and the URL the page shows is
its own. ``unread`` names the parameters a page would silently ignore (the lessons' tests use it).
Pure: no Streamlit here, ``st.query_params`` is just a mutable mapping to ``adopt``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping

__all__ = ["PAGE_FILES", "PAGE_TITLES", "ALIASES", "READS", "MAX_PARAM_CHARS", "adopt", "reads",
           "unread", "url_list"]

# Longer than any list a page offers, spelled out: a longer value is someone else's, not a
# control's.
MAX_PARAM_CHARS = 512

# page name (as Explore names it) -> its file, as st.page_link and AppTest.switch_page take it
PAGE_FILES = {name: f"pages/{name}.py"
              for name in ("collectives", "cost", "training", "runs", "memory")}
PAGE_TITLES = {"collectives": "Collectives", "cost": "Cost", "training": "Training", "runs": "Runs",
               "memory": "Memory"}

# The URL parameters each page reads for its controls (its own names). None: not known here.
READS: dict[str, frozenset[str] | None] = {
    "collectives": frozenset(
        {
            "coll_collective",
            "coll_algorithm",
            "coll_vs",
            "coll_p",
            "coll_n",
            "coll_root",
            "coll_alpha_us",
            "coll_beta_gbps",
            "coll_gamma_gbps",
            "coll_round",
        }
    ),
    "cost": frozenset(
        {
            "world_size",
            "alpha_us",
            "beta_gbps",
            "gamma",
            "sizes",
            "y",
            "algorithms",
            "source",
            "fit_by",
            "bench_world_sizes",
            "bench_sizes",
        }
    ),
    "training": frozenset({"world_size", "steps", "staleness", "backup", "factor", "hidden"}),
    "runs": frozenset(
        {
            "source",
            "world_size",
            "mode",
            "algorithm",
            "bucket_mb",
            "hidden",
            "steps",
            "staleness",
            "backup",
            "straggler",
            "factor",
            "detail",
        }
    ),
    "memory": None,
}


def url_list(raw: str | None, parse: Callable[[str], object], allowed: Iterable[object],
             limit: int) -> list | None:
    """A URL's comma list as a control takes it: parsed, only ``allowed`` values, each once (first
    spelling wins), at most ``limit``. None where ``raw`` is None, longer than ``MAX_PARAM_CHARS``,
    or holds a value that does not parse: the page then uses its default. A URL is anyone's input,
    so its length, not the page's options, would otherwise decide how much work a page does."""
    if raw is None or len(raw) > MAX_PARAM_CHARS:
        return None
    pool, out = list(allowed), []
    for text in raw.split(","):
        if not text.strip():
            continue
        try:
            value = parse(text.strip())
        except (TypeError, ValueError, OverflowError):
            return None
        if value in pool and value not in out:
            out.append(value)
    return out[:limit]


def _first(value: str) -> str:
    """A list given to a one-value control (``world_sizes=2,4`` on a page with one world size)."""
    return value.split(",")[0].strip()


def _same(value: str) -> str:
    return value


# page -> short name -> (the page's own name, how the value becomes its value)
ALIASES: dict[str, dict[str, tuple[str, Callable[[str], str]]]] = {
    "collectives": {short: (f"coll_{short}", _same) for short in
                    ("collective", "algorithm", "vs", "p", "n", "root", "round")}
    | {"world_size": ("coll_p", _same)},
    "cost": {"p": ("world_size", _same), "algorithm": ("algorithms", _same),
             "world_sizes": ("world_size", _first)},
    "training": {"p": ("world_size", _same), "world_sizes": ("world_size", _first)},
    "runs": {"p": ("world_size", _same), "world_sizes": ("world_size", _first)},
}


def reads(page: str) -> frozenset[str] | None:
    """Every parameter ``page`` understands: its own names and their short names (None: unknown)."""
    own = READS.get(page)
    return None if own is None else own | frozenset(ALIASES.get(page, {}))


def unread(page: str, params: dict[str, str]) -> list[str]:
    """The names in ``params`` that ``page`` would ignore: a deep link that opens the wrong
    picture."""
    known = reads(page)
    return [] if known is None else sorted(set(params) - known)


def adopt(query: MutableMapping[str, str], page: str) -> dict[str, str]:
    """Rewrite ``page``'s short names in ``query`` (e.g. ``st.query_params``) into its own names, in
    place.

    A name the page already has wins over its short form (the page's own URL is the more precise);
    the short name is removed either way, so the URL ends up in one spelling. Returns what was set.
    """
    moved = {}
    for short, (own, convert) in ALIASES.get(page, {}).items():
        if short not in query or short == own:
            continue
        value = query[short]
        del query[short]
        if own not in query and own not in moved:
            moved[own] = convert(value)
    for own, value in moved.items():
        query[own] = value
    return moved
