"""Pages that the folders above viz/ add to the app: the Lessons page is the lessons' own.

    for page in added_pages():      # AddedPage(name="lessons", file=.../lessons/page.py, ...)
        st.Page(page.file, title=page.title, icon=page.icon, url_path=page.name)

Imports run down the house (reference < backends < viz < lessons), so the app never imports
``dplab.lessons``: a page from above is an entry point of the group ``dplab.app_pages``
(pyproject.toml) that names an ``AddedPage``, which says where the page's script is and how the
app lists it. ``viz/app.py`` puts these pages after its own; Home links to them first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = ["AddedPage", "added_pages", "APP_PAGES"]

APP_PAGES = "dplab.app_pages"  # the entry-point group


@dataclass(frozen=True)
class AddedPage:
    """A page of the app whose script lives in a folder above viz/."""

    name: str  # its URL path, as a deep link names it: "lessons" is /lessons?lesson=1&step=2
    file: Path  # its script, resolved: st.navigation runs it, st.page_link links to it
    title: str  # in the sidebar and on Home
    icon: str  # in the sidebar (a material icon or an emoji)
    blurb: str  # Home's sentence about what it shows
    # imports its sessions share, before the server serves
    preload: Callable[[], None] = lambda: None


@cache
def added_pages() -> tuple[AddedPage, ...]:
    """The pages the installed dplab declares, in the entry points' order.

    Returns:
        Each entry point of ``dplab.app_pages``, loaded: an ``AddedPage``. Loading imports the
        module that describes the page, never the page's script (that runs in a session).
    """
    from importlib.metadata import entry_points  # slow to import: once per server

    return tuple(ep.load() for ep in entry_points(group=APP_PAGES))
