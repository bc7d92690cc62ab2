"""Several hosts on one machine, for tests and demos of multi-host runs (root only).

    netns.py   Cluster: a network namespace per host on a private bridge, links optionally
               rate-limited; ``python -m dplab.backends.hosts.netns --hosts 2`` keeps one up
"""

__all__: list[str] = []
