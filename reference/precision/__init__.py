"""Mixed precision: half-precision compute copies of fp32 master weights, and loss scaling.

    from dplab.reference.precision import MixedPrecision
    SyncConfig(precision=MixedPrecision(reduce_dtype="float16"))  # TrainConfig(dtype="float32")

``config.py`` the frozen configuration, ``scaler.py`` the loss scaler (static and dynamic, torch's
GradScaler rules) and the float16 compute copy, ``amp.py`` the hook ``train_sync`` attaches.
Other trainers (ZeRO's stages) use the scaler directly: ``compute_copy(master, out)``,
``scaler.loss_scale``, ``scaler.unscale_and_check(comm, grads, out)``, ``scaler.update(found_inf)``.
"""

from dplab.reference.precision.amp import Amp
from dplab.reference.precision.config import MixedPrecision
from dplab.reference.precision.scaler import LossScaler, ScaleEvent, compute_copy

__all__ = ["MixedPrecision", "LossScaler", "ScaleEvent", "compute_copy", "Amp"]
