"""Uplink compression with error feedback: a push carries C(pending + residual), the rest stays.

One mechanism, a few policies, named by a spec string a user can type:

- `auto` (the default): the densest of the encodings below whose push of the
  whole model takes the uplink, as measured, no longer than a quarter of a
  training step (of at least `AUTO_MIN_PUSH_S`): dense where the link is fast,
  top-k where it is slow (`AutoCompression`);
- `none`: the sum as it is (fp32 for an fp32 model);
- `fp16`: half precision;
- `int8`: one byte an element, one scale per `INT8_CHUNK` elements;
- `topk:<ratio>`: the largest `ratio` of each layer's entries, their indices coded
  in 16 bits (`protocol.payload.Sparse`); `topk:<ratio>+fp16` and `topk:<ratio>+int8`
  narrow the values too.

What a push does not carry is the *residual*: the edge keeps it per unit and adds
it into the next push (error feedback, as in Deep Gradient Compression and
EF-SGD), so for every unit

    what pushes carried + residual == what backward produced

and nothing is lost, only delayed.  Encoding is deterministic and happens once,
when a pending sum becomes a flight (edge/cache.py): a re-send of an unanswered
push is the same bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from elasticfed.common.topk import largest_magnitudes
from elasticfed.protocol.payload import SPARSE_BLOCK, Dense, Payload, Quantized, Sparse

INT8_CHUNK = 256  # elements per int8 scale: 1.6% of the codes' bytes for fp32 scales
AUTO_MIN_PUSH_S = 0.2  # `auto` never compresses harder than a push every this long needs
AUTO_PUSH_SHARE = 0.25  # `auto`'s whole-model push takes the uplink this share of a step
AUTO_MIN_RATIO, AUTO_MAX_RATIO = 0.001, 0.25  # the top-k ratios `auto` chooses between
# Probing (`AutoCompression`): every PROBE_EVERY_S a compressing edge sends PROBE_GAIN times its
# budget for PROBE_S, then judges after PROBE_SETTLE_S whether the measured rate grew by
# PROBE_GROWTH (then it probes again at once, doubling towards the link's rate).
PROBE_EVERY_S, PROBE_S, PROBE_SETTLE_S = 10.0, 1.0, 1.0
PROBE_GAIN, PROBE_GROWTH = 2.0, 1.25


@dataclass(frozen=True)
class UplinkCompression:
    """A parsed compression spec; `encode` turns one layer's flat sum into its payload."""

    spec: str
    ratio: float | None = None  # top-k share of each layer's entries; None: every entry
    values: str = "fp32"  # how the carried values travel: fp32 (the layer's dtype), fp16, int8

    @classmethod
    def parse(cls, spec: str) -> UplinkCompression | AutoCompression:
        """From `none`, `fp16`, `int8`, `topk:<r>` or `topk:<r>+fp16|int8`; ValueError says what is wrong."""
        text = spec.strip().lower()
        if text == "auto":
            return AutoCompression()
        if text in ("none", "fp32"):
            return cls("none")
        if text in ("fp16", "int8"):
            return cls(text, values=text)
        head, _, narrow = text.partition("+")
        if not head.startswith("topk:"):
            raise ValueError(
                f"compression {spec!r}: expected auto, none, fp16, int8, topk:<ratio> or "
                "topk:<ratio>+fp16|int8"
            )
        try:
            ratio = float(head[len("topk:") :])
        except ValueError:
            raise ValueError(f"compression {spec!r}: {head[5:]!r} is not a number") from None
        if not 0.0 < ratio < 1.0 or not math.isfinite(ratio):
            raise ValueError(f"compression {spec!r}: the top-k ratio must be in (0, 1), got {ratio}")
        if narrow and narrow not in ("fp16", "int8"):
            raise ValueError(
                f"compression {spec!r}: top-k values may be narrowed to fp16 or int8, not {narrow!r}"
            )
        canonical = f"topk:{ratio:g}" + (f"+{narrow}" if narrow else "")
        return cls(canonical, ratio=ratio, values=narrow or "fp32")

    @property
    def lossy(self) -> bool:
        """Whether pushes leave a residual (everything but `none`)."""
        return self.spec != "none"

    @property
    def encodings(self) -> frozenset[str]:
        """The wire encodings this policy sends, which the gateway must accept."""
        if self.ratio is not None:
            return frozenset({"sparse", "dense"})
        return frozenset({"int8" if self.values == "int8" else "dense"})

    def kept(self, numel: int) -> int:
        """Entries a layer of `numel` elements carries."""
        if self.ratio is None:
            return numel
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def wire_bytes(self, numel: int, itemsize: int) -> int:
        """Payload bytes of one layer (frames only): what a push of it costs on the link."""
        k = self.kept(numel)
        if self.values == "int8":
            values = k + 4 * -(-k // INT8_CHUNK)
        else:
            values = k * (2 if self.values == "fp16" else itemsize)
        if self.ratio is None:
            return values
        return 4 * -(-numel // SPARSE_BLOCK) + 2 * k + values

    def encode(self, flat: torch.Tensor, shape: tuple[int, ...]) -> Payload:
        """The payload of one layer's flat sum (fp32/fp16/bf16 on the CPU); deterministic."""
        if self.ratio is None:
            return self._values(flat, shape)
        k = self.kept(flat.numel())
        if k == flat.numel():
            return self._values(flat, shape)
        indices = largest_magnitudes(flat, k)
        return Sparse.from_indices(indices, self._values(flat[indices], (k,)), shape)

    def _values(self, flat: torch.Tensor, shape: tuple[int, ...]) -> Dense | Quantized:
        if self.values == "fp16":
            return Dense(flat.to(torch.float16).view(shape))
        if self.values == "int8":
            return quantize(flat, shape)
        return Dense(flat.clone().view(shape))


class AutoCompression:
    """The encoding a push needs on the link as measured: `observe` picks, `encode` uses it.

    The budget of a whole-model push is what the uplink carries in a quarter of a training
    step (of at least `AUTO_MIN_PUSH_S`), not in a whole one: a push that fills the link
    for a step arrives a step late, and every version published meanwhile makes it staler.
    On the small text task at 2 Mbit/s, filling the link made pushes 3.4-3.9 versions old,
    a quarter 2.1-2.3 (README, "Bandwidth").  What a push leaves out is delayed in the
    residual, not lost, and its largest entries go at once.  Its share of the dense size picks
    the rung: none (all of it), fp16 (half), int8 (a quarter), else top-k with int8
    values at the ratio that fits (3 bytes an entry).  Until the link is measured it
    sends int8.  Changing rungs between pushes loses nothing: the residual carries
    what one push left out into the next, whatever encodes it.

    The measured rate is a lower bound from what was sent (edge/pacing.py), so an edge
    that compresses to what it measured never learns that the link could carry more:
    on a GPU lender four edges measured 2.2 Mbit/s while the gateway was busy with their
    first downloads and sent top-k 0.003 on a free link for the rest of the run.  So,
    as BBR probes for bandwidth, a compressing edge sends twice its budget for a second
    every ten (about 10% more bytes on a link that is really that slow), and while each
    probe raises the measurement by a quarter it probes again at once.
    """

    spec = "auto"
    lossy = True
    encodings = frozenset({"dense", "int8", "sparse"})

    def __init__(self) -> None:
        self.current: UplinkCompression = UplinkCompression("int8", values="int8")
        self.probes = 0
        self._probe_until: float | None = None  # probing until then
        self._judge_at: float | None = None  # then judged at this time
        self._probe_base = 0.0  # the rate measured when the probe began
        self._next_probe: float | None = None

    def observe(
        self, uplink_bytes_per_s: float, step_s: float, dense_bytes: int, now: float | None = None
    ) -> UplinkCompression:
        """Re-pick the rung from the measured uplink, the time a step takes and the model's dense size
        (probing for more now and then when given the time)."""
        gain = 1.0 if now is None else self._probe(uplink_bytes_per_s, now)
        budget = gain * AUTO_PUSH_SHARE * uplink_bytes_per_s * max(step_s, AUTO_MIN_PUSH_S)
        share = budget / max(dense_bytes, 1)
        if share >= 1.0:
            self.current = UplinkCompression("none")
        elif share >= 0.5:
            self.current = UplinkCompression("fp16", values="fp16")
        elif share >= 0.26:
            self.current = UplinkCompression("int8", values="int8")
        else:
            ratio = min(AUTO_MAX_RATIO, max(AUTO_MIN_RATIO, share * 4 / 3.1))
            ratio = float(f"{ratio:.1g}")  # a few distinct rungs, not a new one per measurement
            self.current = UplinkCompression(f"topk:{ratio:g}+int8", ratio=ratio, values="int8")
        return self.current

    @property
    def probing(self) -> bool:
        return self._probe_until is not None

    def _probe(self, rate: float, now: float) -> float:
        """The budget's gain now: PROBE_GAIN while a probe runs, else 1."""
        if self._probe_until is not None:
            if now < self._probe_until:
                return PROBE_GAIN
            self._probe_until, self._judge_at = None, now + PROBE_SETTLE_S  # its answers still come
        if self._judge_at is not None:
            if now < self._judge_at:
                return 1.0
            self._judge_at = None
            grew = rate >= PROBE_GROWTH * self._probe_base
            self._next_probe = now if grew else now + PROBE_EVERY_S
        if self._next_probe is None:
            self._next_probe = now + PROBE_EVERY_S
        if now < self._next_probe or not self.current.lossy:
            return 1.0
        self._probe_until, self._probe_base = now + PROBE_S, rate
        self.probes += 1
        return PROBE_GAIN

    def kept(self, numel: int) -> int:
        return self.current.kept(numel)

    def wire_bytes(self, numel: int, itemsize: int) -> int:
        return self.current.wire_bytes(numel, itemsize)

    def encode(self, flat: torch.Tensor, shape: tuple[int, ...]) -> Payload:
        if not self.current.lossy:  # dense at this moment: a copy (the residual buffer rotates)
            return Dense(flat.clone().view(shape))
        return self.current.encode(flat, shape)


Compression = UplinkCompression | AutoCompression


def quantize(flat: torch.Tensor, shape: tuple[int, ...], chunk: int = INT8_CHUNK) -> Quantized:
    """Symmetric int8 with one scale (max |x| / 127) per chunk, rounded to nearest."""
    n = flat.numel()
    wide = flat.float()
    pad = -n % chunk
    padded = torch.nn.functional.pad(wide, (0, pad)).view(-1, chunk) if n else wide.view(0, chunk)
    scales = padded.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / safe[:, None]).clamp_(-127, 127).to(torch.int8).view(-1)[:n]
    return Quantized(
        codes.contiguous(), scales.to(flat.dtype if flat.is_floating_point() else torch.float32), chunk, shape
    )
