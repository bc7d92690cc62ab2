"""The app's pages, one file each, run by ``st.navigation`` in ``viz/app.py``.

A page reads its controls (each with an explicit ``key=``, mirrored in ``st.query_params`` for
deep links), calls pure builders from ``dplab.viz`` and shows what they return.
"""

__all__: list[str] = []
