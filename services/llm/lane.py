"""Where a step runs: its stream, its staging buffer and its token fetch.

With `--lanes shared` the runner has one lane, and a step carries prompts and decodes together.
With `--lanes split` it has two, `prefill` and `decode`, each with inputs of its own, so a step of
each can be in flight at once. On CUDA the prefill lane's stream belongs to a green context of
its own SMs (services/llm/sm_partition.py), and its graphs are captured there; the decode lane's
is a stream of its own on the whole device.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from services.llm.fetch import TokenFetch
from services.llm.request import Request
from services.llm.scheduler import Chunk
from services.llm.staging import Staging


@dataclass
class Lane:
    name: str  # shared, prefill or decode
    stream: torch.cuda.Stream | None  # None: the current stream (the CPU, or the shared lane)
    staging: Staging
    fetches: tuple[TokenFetch, TokenFetch]  # taken in turn: a step in flight and the one after it
    sms: int = 0  # the SMs its stream may use; 0: the whole device
    partition: object = None  # the green context its stream belongs to, kept alive with it
    turn: int = 0

    def on(self):
        """The context its device work is queued in."""
        return nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    def take(self) -> TokenFetch:
        """The fetch for the next step launched on this lane."""
        self.turn ^= 1
        return self.fetches[self.turn]


@dataclass
class Launched:
    """A step launched on a lane whose tokens are not handed out yet."""

    chunks: list[Chunk]
    decodes: list[Request]
    fetch: TokenFetch | None  # its tokens (None until its launch returns)
    launched: float  # host clock when its launch began

    @property
    def held(self) -> list[Request]:
        return [c.req for c in self.chunks] + self.decodes


def default_prefill_sms(total: int) -> int:
    """Three quarters of the device's SMs, in the driver's granularity (8 on Hopper): 96 of the
    H200's 132.

    On the H200 (bench.sm_split, twelfth session): one W1 prompt's prefill took 13.1 ms on all 132
    SMs, 19.9 on 96, 23.2 on 64; with a decode step running beside it, it took 26.8 on 96 and the
    decode (captured on the whole device) 8.4 ms against 5.4 alone at batch 8. Confined to the other
    36 SMs the decode took 8.6 alone. So only the prefill is confined; neither layout makes the two
    steps together much cheaper than one after the other (overlap 1.09-1.18, docs/PERF.md).
    """
    return max(8, total * 3 // 4 // 8 * 8)


def build_lanes(
    split: bool,
    device: torch.device,
    max_batch: int,
    decode_words: int,
    packed_words: int,
    extra_words: int,
    prefill_sms: int = 0,
    decode_priority: str = "normal",
) -> dict[str, Lane]:
    """The runner's lanes: their staging buffers hold the decode step's fixed inputs (`decode_words`),
    the packed step's (`packed_words`) and `extra_words` for a step's other values.

    Split on CUDA: the prefill lane on a green context of `prefill_sms` SMs (0:
    `default_prefill_sms`; the device's count or more: a plain stream on the whole device); the
    decode lane on a stream of its own on the whole device, of `decode_priority` (high: its blocks
    go first wherever an SM frees, the prefill's own included): its kernels take the SMs the
    prefill leaves, and room beside the prefill's blocks. A green context does not keep other
    contexts off its SMs, so the two lanes' kernels still meet on the prefill's (docs/PERF.md).
    RuntimeError where the device cannot be split.
    """
    cuda = device.type == "cuda"

    def lane(name: str, fixed: int, extra: int) -> Lane:
        fetches = (TokenFetch(max_batch, device), TokenFetch(max_batch, device))
        return Lane(name, None, Staging(fixed + extra, fixed, device), fetches)

    if not split:
        return {"shared": lane("shared", decode_words + packed_words, extra_words)}
    prefill = lane("prefill", packed_words, extra_words)
    lanes = {"prefill": prefill, "decode": lane("decode", decode_words, 8 * max_batch)}  # + sampling parameters
    if cuda:
        from services.llm.sm_partition import device_sms, split_sms

        total = device_sms(device)
        sms = prefill_sms or default_prefill_sms(total)
        if sms >= total:
            prefill.stream = torch.cuda.Stream(device)
        else:
            try:
                part, _ = split_sms(sms, device, rest_part=False)
            except RuntimeError as err:
                raise RuntimeError(f"--lanes split --prefill-sms {sms}: {err}") from err
            prefill.stream, prefill.sms, prefill.partition = part.stream, part.sms, part
        lanes["decode"].stream = torch.cuda.Stream(device, priority=-1 if decode_priority == "high" else 0)
    return lanes
