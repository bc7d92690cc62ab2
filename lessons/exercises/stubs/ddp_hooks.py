"""Exercise (lesson 15): DDP from hooks on torch tensors.

DDP averages every parameter's gradient over the ranks during backward. Here you build it from
torch's own parts, as CS336 asks: a hook on each parameter that fires when backward has finished
that parameter's gradient, an asynchronous all-reduce launched from it (so that it runs while
backward computes the earlier layers), and a wait for all of them before the optimizer steps.

Write ``attach_ddp_hooks(model)``. It runs on every rank (torch.distributed is set up: gloo, two
ranks; every rank's model starts with the same weights). Register, on every parameter with
``requires_grad``, a hook with ``param.register_post_accumulate_grad_hook(hook)``; ``hook(param)``
is called once per backward, when ``param.grad`` is complete. Return ``finish()``: the training
loop calls it after ``loss.backward()`` and before ``opt.step()``, and when it returns every
``param.grad`` must hold the average over the ranks of their gradients.

    finish = attach_ddp_hooks(model)
    for x, y in my_half_of_each_batch:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # your hooks launch the all-reduces in here
        finish()                          # ... and this waits for them
        opt.step()

Useful: ``torch.distributed.all_reduce(tensor, async_op=True)`` sums ``tensor`` over the ranks in
place and returns a handle with ``.wait()``; ``torch.distributed.get_world_size()``.

The hooks below are registered, but they launch nothing. Check it:

    dplab lesson check 15 DIR
"""

from __future__ import annotations

import torch.distributed as dist  # noqa: F401  (you will need it)


def attach_ddp_hooks(model):
    handles = []

    def hook(param):
        pass  # TODO: launch the all-reduce of this parameter's gradient, keep its handle

    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)

    def finish():
        handles.clear()  # TODO: wait for every launched all-reduce first

    return finish
