"""The app's entry: ``st.navigation`` over file pages, Home first, each page reachable."""

from __future__ import annotations

import pytest

st = pytest.importorskip("streamlit", reason="the viz extra is not installed: pip install "
                                             "'dplab[viz]'")
pytest.importorskip("plotly", reason="the viz extra is not installed: pip install 'dplab[viz]'")
from streamlit.testing.v1 import AppTest  # noqa: E402

from dplab.viz.serve import app_path  # noqa: E402


def test_home_is_the_default_page_and_links_to_collectives():
    at = AppTest.from_file(str(app_path()), default_timeout=30).run()
    assert not at.exception
    assert [t.value for t in at.title] == ["dplab: Data-Parallel Lab"]
    links = at.get("page_link")
    labels = [link.proto.label for link in links]
    assert "Collectives" in labels
    assert all(link.proto.page_script_hash for link in links)  # every link goes to a listed page


def test_collectives_page_is_reachable_by_its_file():
    at = AppTest.from_file(str(app_path()), default_timeout=30).run()
    at.switch_page("pages/collectives.py").run()
    assert not at.exception
    assert at.title[0].value == "Collectives"
