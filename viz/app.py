"""The dplab app's entry: one ``st.Page`` per file under ``viz/pages/``, behind ``st.navigation``.

    dplab app                       # prints http://127.0.0.1:<port>; Ctrl-C stops it
    streamlit run viz/app.py        # the same, from a checkout

Adding a page is one line in ``PAGES`` (its file under ``viz/pages/``): pages are files, so
``st.switch_page`` and ``AppTest.switch_page("pages/<name>.py")`` reach them. A page whose code
lives above viz/ (the Lessons page, in lessons/) comes after them, from its entry point
(``dplab.viz.added_pages``): the app does not import it.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from dplab.viz.added_pages import added_pages

PAGES_DIR = Path(__file__).resolve().parent / "pages"

st.set_page_config(page_title="dplab", page_icon="🔁", layout="wide")

PAGES = [
    st.Page(PAGES_DIR / "home.py", title="Home", icon=":material/home:", default=True),
    st.Page(PAGES_DIR / "collectives.py", title="Collectives", icon=":material/sync_alt:"),
    st.Page(PAGES_DIR / "runs.py", title="Runs", icon=":material/timeline:"),
    st.Page(PAGES_DIR / "cost.py", title="Cost", icon="📈"),
    st.Page(PAGES_DIR / "training.py", title="Training", icon=":material/model_training:"),
    *(st.Page(p.file, title=p.title, icon=p.icon, url_path=p.name) for p in added_pages()),
]

st.navigation(PAGES).run()
