"""Where a step runs: its stream, its staging buffer and its token fetch.

With `--lanes shared` the runner has one lane, and a step carries prompts and decodes together.
With `--lanes split` it has two, `prefill` and `decode`, each with inputs of its own, so a step of
each can be in flight at once; on CUDA each lane's stream belongs to a green context of its own
SMs (services/llm/sm_partition.py) and its graphs are captured there.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from services.llm.fetch import TokenFetch
from services.llm.staging import Staging

LANES = ("shared", "split")


@dataclass
class Lane:
    name: str  # shared, prefill or decode
    stream: torch.cuda.Stream | None  # None: the current stream (the CPU, or the shared lane)
    staging: Staging
    fetch: TokenFetch
    sms: int = 0  # the SMs its stream may use; 0: the whole device
    partition: object = None  # the green context its stream belongs to, kept alive with it

    def on(self):
        """The context its device work is queued in."""
        return nullcontext() if self.stream is None else torch.cuda.stream(self.stream)


def default_prefill_sms(total: int) -> int:
    """Half the device's SMs, in the driver's granularity (8 on Hopper): 64 of the H200's 132.

    On the H200 a prefill of one W1 prompt took 23.2 ms on 64 SMs (13.6 on all 132) and the
    decode step on the other 68 ran at its whole-device time beside it (5.8 against 5.5 ms at
    batch 8, 5.9 at 16): the decode is bound by memory bandwidth, which 68 SMs still draw.
    """
    return max(8, total // 2 // 8 * 8)


def build_lanes(
    split: bool,
    device: torch.device,
    max_batch: int,
    decode_words: int,
    packed_words: int,
    extra_words: int,
    prefill_sms: int = 0,
) -> dict[str, Lane]:
    """The runner's lanes: their staging buffers hold the decode step's fixed inputs (`decode_words`),
    the packed step's (`packed_words`) and `extra_words` for a step's other values.

    Split on CUDA: the prefill lane on `prefill_sms` SMs (0: `default_prefill_sms`), the decode
    lane on the rest. RuntimeError where the device cannot be split.
    """
    cuda = device.type == "cuda"
    if not split:
        fixed = decode_words + packed_words
        return {
            "shared": Lane("shared", None, Staging(fixed + extra_words, fixed, device), TokenFetch(max_batch, cuda))
        }
    streams, sms, keep = (None, None), (0, 0), ()
    if cuda:
        from services.llm.sm_partition import device_sms, split_sms

        pre, rest = split_sms(prefill_sms or default_prefill_sms(device_sms(device)), device)
        streams, sms, keep = (pre.stream, rest.stream), (pre.sms, rest.sms), (pre, rest)
    prefill = Staging(packed_words + extra_words, packed_words, device)
    decode = Staging(decode_words + 8 * max_batch, decode_words, device)  # and the sampling parameters
    lanes = {
        "prefill": Lane("prefill", streams[0], prefill, TokenFetch(max_batch, cuda), sms[0]),
        "decode": Lane("decode", streams[1], decode, TokenFetch(max_batch, cuda), sms[1]),
    }
    for lane, part in zip(lanes.values(), keep, strict=False):
        lane.partition = part
    return lanes
