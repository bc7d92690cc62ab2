"""The measured rows behind ``backends/PERFORMANCE.md``, and the generator of its tables.

    tables.py    python -m dplab.backends.perf.tables --write backends/PERFORMANCE.md
    measure.sh   the commands that wrote the ``*.json`` rows here
"""

__all__: list[str] = []
