"""The checks a push passes before it enters a round, each returning a verdict or nothing.

Why a module of its own: exactly-once, the window, staleness admission and the payload bounds
are the gateway's promises to edges, and each is a small rule over a push and what the gateway
remembers of its edge (cloud/clients.py).  Here they are pure functions that decide; the
gateway runs them in order (`Gateway._on_push`) and carries out the first verdict in one place
(`Gateway._answer`: recorded under the seq, counted, logged, acknowledged).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elasticfed.cloud.aggregation import Weighting, entries
from elasticfed.cloud.clients import ClientState
from elasticfed.protocol import Dense, Push, PushHead, Reason, all_finite

# An edge part-way through a download is judged by the version it is fetching for this long
# after its last chunk request; never beyond this many times max_staleness (avoidable_staleness).
FETCH_GRACE_S = 30.0
HARD_STALENESS_FACTOR = 4
NORM_POLICIES = ("clip", "reject")


@dataclass(frozen=True)
class Verdict:
    """The gateway's answer to one push, as the ack carries it and as it is remembered."""

    accepted: bool
    code: str = ""  # the ack's code: "" applied, a Reason's value, or an earlier verdict's
    detail: str = ""
    attempt: int = 0  # the copy of the push judged (the edge times its re-sends by it)
    epoch: int = 0  # applied: the checkpoint that will hold it (0: none)
    recorded: bool = True  # kept under the seq, so a copy sent again gets this verdict again
    # An earlier verdict answered again (a duplicate): counted as a duplicate, not as a second
    # refusal or drop, and not recorded again.
    repeat: bool = False
    logged: bool = False  # a refusal that means a broken or hostile edge: logged, rate-limited

    @classmethod
    def applied(cls, attempt: int, epoch: int) -> Verdict:
        return cls(True, attempt=attempt, epoch=epoch)

    @classmethod
    def refused(
        cls, reason: Reason, detail: str, attempt: int = 0, *, recorded: bool = True, logged: bool = False
    ) -> Verdict:
        return cls(False, reason.value, detail, attempt, recorded=recorded, logged=logged)


def repeated(state: ClientState, msg: Push | PushHead, durable_epoch: int) -> Verdict | None:
    """A push judged before gets its first verdict again, never a second application.

    Below `resolved_below` the verdict is forgotten: the push was judged in this model's history, at
    the latest in the checkpoint of the newest epoch forgotten (or the restored one)."""
    if msg.seq >= state.resolved_below and msg.seq not in state.verdicts:
        return None
    forgotten = state.forgotten_epoch or durable_epoch
    code, attempt, epoch = state.verdicts.get(msg.seq, ("", 0, forgotten))
    return Verdict(
        not code,
        code or Reason.DUPLICATE.value,
        "answered before; not applied again",
        attempt,
        epoch,
        recorded=False,
        repeat=True,
    )


def beyond_window(state: ClientState, msg: Push, window: int) -> Verdict | None:
    """A push too far ahead of `resolved_below` is refused unremembered: the edge sends it again later."""
    if msg.seq < state.resolved_below + window and len(state.verdicts) < window:
        return None
    return Verdict.refused(
        Reason.WINDOW, f"seq {msg.seq} is beyond the window from {state.resolved_below}", recorded=False
    )


def avoidable_staleness(
    state: ClientState, base_version: int, newest: int, weighting: Weighting, now: float
) -> int:
    """Versions behind that the edge could have avoided: what admission (max_staleness) judges.

    An edge part-way through downloading version v could not have trained from anything newer:
    versions published since it started are the link's doing, not the edge's, and dropping its
    work for them would stall a fleet whose downloads take longer than `max_staleness` rounds.
    Those pushes are still weighed by their whole staleness.  An edge that stopped downloading
    (FETCH_GRACE_S), or whose last fetch is the model it trains from (an edge fetches a model only
    when it will adopt one), is judged against the newest version, and nothing is admitted beyond
    HARD_STALENESS_FACTOR x max_staleness whatever the link.
    """
    whole = max(0, newest - base_version)
    if now - state.fetched_at > FETCH_GRACE_S or state.fetching >= newest:
        return whole
    if state.fetching <= base_version:
        return whole  # it fetched what it trains from and nothing newer since: not mid-download
    if not weighting.admit(whole // HARD_STALENESS_FACTOR):
        return whole
    return max(0, state.fetching - base_version)


def too_stale(msg: Push, staleness: int, avoidable: int, weighting: Weighting) -> Verdict | None:
    """Work from a model too old for the weighting to admit is dropped (and counted as dropped)."""
    if weighting.admit(avoidable):
        return None
    return Verdict.refused(Reason.STALE, f"{staleness} versions behind", msg.attempt)


def not_finite(msg: Push, parts: Sequence[torch.Tensor]) -> Verdict | None:
    """The codec checked the frames; int8 codes times their scale or a low-rank product can still
    overflow (fp16 above 65504) once expanded."""
    for layer, tensor in zip(msg.layers, parts):
        if not isinstance(layer.payload, Dense) and not all_finite(entries(tensor)):
            detail = f"layer {layer.name}: NaN or Inf once expanded from {type(layer.payload).__name__}"
            return Verdict.refused(Reason.NONFINITE, detail, msg.attempt, logged=True)
    return None


def norm_factors(
    msg: Push, parts: Sequence[torch.Tensor], bound: float, policy: str, weighting: Weighting
) -> Verdict | list[float]:
    """Per layer, the factor that brings a step's mean gradient norm within `bound` (1.0: within
    already; 0 bound: no bound), or, under the `reject` policy, the refusal of the whole push."""
    factors = [1.0] * len(parts)
    if bound <= 0:
        return factors
    for j, (layer, tensor) in enumerate(zip(msg.layers, parts)):
        wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        norm = float(torch.linalg.vector_norm(entries(tensor), dtype=wide))  # unique indices
        norm /= weighting.share(layer.count)
        if norm <= bound:
            continue
        if policy == "reject":
            detail = f"layer {layer.name}: gradient norm {norm:.4g} is over the bound {bound:.4g}"
            return Verdict.refused(Reason.NORM, detail, msg.attempt, logged=True)
        factors[j] = bound / norm
    return factors
