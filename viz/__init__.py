"""The dplab app: a Streamlit + plotly visualizer of the code that runs.

    dplab app                       # serves viz/app.py; open the URL it prints
    streamlit run viz/app.py        # the same, from a checkout

Pure builders live in ``viz/*.py`` and import no Streamlit: they take dplab objects (a
``Schedule``, the simulator, traces, bench and compare rows) and return plotly figures, tables
and numbers, so the tests and the lessons use them directly. ``viz/pages/*.py`` only wire
controls to builders; ``viz/app.py`` lists the pages.
"""

__all__: list[str] = []
