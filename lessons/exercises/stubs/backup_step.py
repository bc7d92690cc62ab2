"""Exercise (lesson 8): one update of synchronous SGD with backup workers (Chen et al. 2016).

N + b workers each compute a gradient on their own random minibatch; the server builds the update
from the FIRST n gradients to arrive and drops the rest (the b backups). So a step no longer
waits for the slowest worker: it ends when the n-th gradient arrives.

Write ``backup_step(arrivals, grads, n)``:

    arrivals[w]  when worker w's gradient reaches the server (seconds after the step began)
    grads[w]     worker w's gradient: a 1-D numpy array (the mean over its minibatch)
    n            how many gradients make an update (1 <= n <= len(arrivals))

Return ``(update, t_end)``: ``update`` is the MEAN of the n gradients used, added up in worker
order (lowest worker number first, so its bits do not depend on the order they came in);
``t_end`` is when the step ends. Two gradients arriving at the same time: the lower worker
counts as first.

The body below is plain synchronous SGD: it waits for everyone.

Check it (on 200 cases, then on the lesson's simulated clock):

    dplab lesson check 8 DIR
"""

from __future__ import annotations

import numpy as np


def backup_step(arrivals, grads, n):
    return np.mean(grads, axis=0), max(arrivals)  # TODO: waits for everyone
