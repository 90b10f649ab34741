"""`ElasticEdge`: wrap a model on a Jetson; backward pushes each layer to the gateway.

The training loop stays the user's own:

    model = ElasticEdge(net, SessionOptions(gateway="tcp://gw:7878", client_id="cam-7"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.follow(optimizer)               # push the moves it makes (edge/direction.py)
    for x, y in loader:
        loss = loss_fn(model(x), y)       # forward first adopts a newer global model, if one came
        optimizer.zero_grad(); loss.backward(); optimizer.step()
    model.close(drain_s=30)               # deliver what is still cached

Backward runs the same hook manager as the cloud (`common/gradient_hooks.py`); this
module's sink adds each ready unit's gradient into the CPU cache and, on a sync
step (every `sync_every` backwards), asks the session to push it right away, so
layers leave while backward is still producing the earlier ones.  Nothing here
waits on the network: a slow or dead link only makes the cached counts grow.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from elasticfed.common.gradient_hooks import GradientHooks, pack_by_size, trainable_parameters
from elasticfed.common.transport import Link
from elasticfed.edge.cache import GradientCache
from elasticfed.edge.compression import Compression, UplinkCompression
from elasticfed.edge.config import DRIFT_HORIZON, LOCAL_STEPS
from elasticfed.edge.direction import Direction, RawGradient, SgdDirection
from elasticfed.edge.drift import ControlVariates, Horizon, Proximal
from elasticfed.edge.session import EdgeSession, SessionOptions
from elasticfed.protocol import Manifest, blob
from elasticfed.protocol.messages import MAX_RATE, is_rate

_RAW = RawGradient()

log = logging.getLogger("elasticfed.edge")


class ElasticEdge(nn.Module):
    """A model whose gradients are pushed to the gateway under the Elastic Sync Protocol."""

    def __init__(
        self,
        module: nn.Module,
        options: SessionOptions,
        *,
        sync_every: int = 1,
        local_steps: int = LOCAL_STEPS,
        pack_cap_bytes: int = 1 << 20,
        model_version: int = 0,
        start: bool = True,
        compression: str | Compression = "auto",
        audit: bool = False,
        proximal_mu: float = 0.0,
        drift_horizon: int = DRIFT_HORIZON,
        lr: float | None = None,
        scaffold: bool = False,
        link: Link | None = None,
    ) -> None:
        super().__init__()
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        if local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {local_steps}")
        if lr is not None and not is_rate(lr):
            raise ValueError(f"lr must be a learning rate in (0, {MAX_RATE:g}], got {lr!r}")
        if isinstance(compression, str):
            compression = UplinkCompression.parse(compression)
        self.module = module
        self.sync_every = sync_every
        self.local_steps = local_steps
        named = trainable_parameters(module)
        self.manifest = Manifest.from_parameters(module.named_parameters())
        sizes = [p.numel() * p.element_size() for _, p in named]
        plan = pack_by_size(sizes, [p.dtype for _, p in named], pack_cap_bytes)
        self.cache = GradientCache(
            [[(named[i][0], tuple(named[i][1].shape), named[i][1].dtype) for i in unit] for unit in plan],
            pin_memory=any(p.is_cuda for _, p in named),
            compression=compression,
            audit=audit,
        )
        self._by_name = dict(named)
        # FedProx (edge/drift.py): each step pulled back towards the last adopted global model.
        self.drift = Proximal([p for _, p in named], proximal_mu) if proximal_mu else None
        self.horizon = Horizon(drift_horizon) if drift_horizon else None
        # SCAFFOLD (edge/drift.py): g - c_i + c, c read off the adopted models' step mass.
        self.variates = ControlVariates([p for _, p in named]) if scaffold else None
        self._massless_warned = False  # SCAFFOLD's two warnings, each once
        self._rateless_warned = False
        self.since_adopted = 0  # steps taken from the model loaded last (the bound's clock)
        self.version = model_version  # the global model version this edge trains from
        self.steps = 0  # backwards that reached the sink
        self.models_adopted = 0
        # Step-gradients not cached because they held NaN/Inf (a local model that diverged): they
        # are neither produced nor sent, and the edge fetches the global model again.
        self.nonfinite_steps = 0
        self._diverged = False
        self._adopt_now = False  # the local model diverged: the next global model replaces it at once
        self.lr = lr  # the local rate, where no followed optimizer says it
        self._followed: SgdDirection | None = None  # the optimizer whose steps (and rates) we know
        self.session = EdgeSession(options, self.manifest, self.cache, model_version, link=link)
        # The model as built: the gateway's first version where both used the same seed, so the
        # first model comes down as a patch from it (edge/download.py), not whole.
        self.session.download.hold(
            model_version,
            blob.pack(self.manifest, {n: p.detach().to("cpu") for n, p in module.named_parameters()}),
        )
        self.hooks = GradientHooks(named, self, plan)
        if start:
            self.session.start()

    def follow(self, optimizer: torch.optim.Optimizer) -> None:
        """Push what `optimizer.step()` moves each parameter by (over its learning rate) instead of
        the raw gradient, where the gateway applies no momentum of its own (it says which in its
        welcome): with momentum the two differ tenfold (edge/direction.py).  Its rates, schedules
        included, weigh each step, so the gateway needs no edge learning rate of its own.

        Without `follow` (or `lr=`), pushes say no rate and the gateway assumes its configured one.
        """
        self._followed = SgdDirection(optimizer)

    @property
    def direction(self) -> Direction:
        """What a step pushes: momentum is applied once, here or at the gateway (its welcome says)."""
        if self._followed is not None and self.session.push == "step":
            return self._followed
        return _RAW

    # -------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.adopt_newest()
        if self.variates is not None:
            self._correct_drift()
        return self.hooks.arm(self.module(*args, **kwargs))

    def adopt_newest(self) -> bool:
        """Load the newest global model the gateway sent, if it is not loaded yet and this
        model's `local_steps` are done (the first model and one replacing a diverged local
        model at once)."""
        self.session.raise_if_failed()
        if self.models_adopted and self.since_adopted < self.local_steps and not self._adopt_now:
            return False  # the session keeps the newest; taken after the local steps
        model = self.session.take_model()
        if model is None:
            return False
        with torch.no_grad():
            for layer in model.layers:
                param = self._by_name[layer.name]
                param.copy_(layer.payload.tensor, non_blocking=True)
        self.version = model.version
        self.models_adopted += 1
        self.since_adopted = 0
        self._adopt_now = False
        self.session.expect_adoption(self._steps_to_adoption())
        if self.drift is not None:
            self.drift.rebase(list(self._by_name.values()))
        if self.variates is not None:
            self._adopt_variates(model.version, model.mass)
        # Pushing its steps, the edge restarts their momentum with each global model; pushing raw
        # gradients (a no-op restart) it leaves the local optimizer as the user runs it.
        self.direction.restart()
        return True

    def _adopt_variates(self, version: int, mass: float) -> None:
        assert self.variates is not None
        if version and not mass and not self._massless_warned:
            self._massless_warned = True
            log.warning(
                "model %d says no step mass (the gateway's optimizer adds momentum or adapts its "
                "steps, or hybrid mode): SCAFFOLD's fleet direction is not known, steps go uncorrected",
                version,
            )
        self.variates.adopt(list(self._by_name.values()), mass)

    def _correct_drift(self) -> None:
        """SCAFFOLD's move for the steps since the last forward pass, at the cache's rate unit (its
        directions' unit): -rate x (c - c_i) each."""
        assert self.variates is not None
        rate = self.cache.lr
        if rate is None:
            if self.steps and not self._rateless_warned:
                self._rateless_warned = True
                log.warning("SCAFFOLD needs the edge's learning rate (follow() or lr=): steps go uncorrected")
            return
        self.variates.correct(list(self._by_name.values()), rate)

    def wait_ready(self, timeout_s: float, stop: threading.Event | None = None) -> bool:
        """Wait (bounded, and no longer than `stop` is clear) until the gateway welcomed this edge
        and its newest model is loaded.

        Only for the start: once training runs, nothing waits on the network.
        """
        stop = stop or threading.Event()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.adopt_newest()
            session = self.session
            if session.welcomed and session.announced <= self.version:
                return True
            if stop.wait(0.005):
                return False
        return False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate in `.grad` without pushing (micro-batches of one step)."""
        with self.hooks.disabled():
            yield

    # ------------------------------------------------------------ GradientSink
    def unit_ready(self, unit: int) -> None:
        params = [self.hooks.params[i] for i in self.hooks.plan[unit]]
        if self.horizon is not None:
            self.horizon.scale(params, self.since_adopted + 1)  # the data's gradient, not the pull
        if self.drift is not None:
            self.drift.pull(params)  # before the pushed direction and the local step read .grad
        direction = self.direction
        grads = [None if p.grad is None else direction(p, p.grad) for p in params]
        rates = self._rates(params)
        if rates is not None:
            # Each step enters the sums times its rate over the cache's unit: the gateway then turns
            # any sum into the move it made (unit x sum), whatever schedule ran.  At a constant
            # rate the factor is 1 and nothing is computed.
            unit_lr = self.cache.rate_unit(rates[0])
            grads = [g if g is None or r == unit_lr else g * (r / unit_lr) for g, r in zip(grads, rates)]
        if not _finite(grads):
            # One NaN would poison every later step summed with it, and the gateway refuses it.
            self._diverged = True
            return
        self.cache.add(unit, grads, self.version)
        if self.variates is not None:  # what is pushed: the uncorrected directions, at the horizon's scale
            scale = self.horizon.factor(self.since_adopted + 1) if self.horizon is not None else 1.0
            self.variates.observe(params, grads, scale)
        if (self.steps + 1) % self.sync_every == 0:
            self.session.request_sync([unit])

    def _rates(self, params: list[nn.Parameter]) -> list[float] | None:
        """Each parameter's learning rate this step; None where nobody said (the gateway assumes)."""
        if self._followed is not None:
            return [self._followed.lr(p) for p in params]
        if self.lr is not None:
            return [self.lr] * len(params)
        return None

    def backward_done(self) -> None:
        self.steps += 1
        self.since_adopted += 1
        if self._diverged:
            self._diverged = False
            self.nonfinite_steps += 1
            if self.nonfinite_steps == 1 or self.nonfinite_steps % 100 == 0:
                log.warning(
                    "step %d produced NaN/Inf gradients (%d such steps): not sent; fetching the global "
                    "model again (a smaller --train-lr may be needed)",
                    self.steps,
                    self.nonfinite_steps,
                )
            self._adopt_now = True
            self.session.refetch_model()
        self.session.expect_adoption(self._steps_to_adoption())

    def _steps_to_adoption(self) -> int:
        """Steps until `adopt_newest` takes a model: the session fetches in time for it."""
        if not self.models_adopted or self._adopt_now:
            return 0
        return max(0, self.local_steps - self.since_adopted)

    # -------------------------------------------------------------------- the end
    def close(self, drain_s: float = 0.0) -> bool:
        """Stop syncing, after waiting up to `drain_s` for everything cached to be delivered."""
        self.hooks.remove()
        return self.session.close(drain_s)

    def status(self) -> dict[str, object]:
        out = self.session.status()
        out.update(
            steps=self.steps,
            trained_from_version=self.version,
            models_adopted=self.models_adopted,
            steps_since_adopted=self.since_adopted,
            nonfinite_steps=self.nonfinite_steps,
        )
        if self.variates is not None:  # stretches the fleet's direction was read off (0: uncorrected)
            out["scaffold_stretches"] = self.variates.stretches
        # Counts over this device's saved history (edge/persistence.py), not only this process.
        out["produced_steps"] = {name: unit.produced for unit in self.cache.units for name in unit.names}
        out["durable_by_layer"] = {name: unit.durable for unit in self.cache.units for name in unit.names}
        out["dropped_by_layer"] = {name: unit.dropped for unit in self.cache.units for name in unit.names}
        held = self.cache.undelivered_by_unit()
        out["undelivered_by_layer"] = {
            name: held[unit.index] for unit in self.cache.units for name in unit.names
        }
        return out


def _finite(grads: list[torch.Tensor | None]) -> bool:
    """A sum per tensor read as a Python float (NaN and Inf survive a sum): about 5 us a tensor,
    a third of a tensor-side `isfinite`, which cost a tenth of a small model's step.  A sum that
    overflows is checked element by element.  On a GPU the read would synchronise every unit, so
    GPU gradients are left to the gateway's check."""
    for g in grads:
        if g is not None and g.device.type == "cpu" and not math.isfinite(g.sum().item()):
            if not bool(torch.isfinite(g).all()):
                return False
    return True
