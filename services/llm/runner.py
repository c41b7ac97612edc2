"""The model runner: decoder weights, the KV cache, prefill and decode forwards, sampling.

KV cache: k, v [layers, slots, kv_heads, max_context, head_dim], allocated once.
"""

from __future__ import annotations

import logging

import torch

from services.llm.request import Request
from services.model.checkpoint import load_decoder
from services.model.llama import rope_cos_sin, rope_inv_freq
from services.model.spec import LlavaSpec

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, spec: LlavaSpec, device: torch.device, dtype: torch.dtype, slots: int) -> None:
        self.spec = spec
        self.device, self.dtype = device, dtype
        t = spec.text
        self.model = load_decoder(spec, device, dtype)
        self.max_context = t.max_context
        shape = (t.layers, slots, t.kv_heads, t.max_context, t.head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.inv_freq, self.rope_scale = rope_inv_freq(spec, device)
        self.positions = torch.arange(t.max_context, device=device)
        self.eos = torch.tensor(t.eos_token_ids or [-1], device=device)
        kv_gib = 2 * self.k_cache.numel() * self.k_cache.element_size() / 2**30
        log.info(
            "decoder loaded: %d layers x %d, KV cache %d slots x %d positions (%.2f GiB), %s on %s",
            t.layers,
            t.hidden,
            slots,
            t.max_context,
            kv_gib,
            dtype,
            device,
        )

    def _embed_prompt(self, req: Request, ids: list[int]) -> torch.Tensor:
        """Token embeddings with each image's features scattered in: [1, T, H]."""
        ids = torch.tensor(ids, device=self.device)
        embeds = self.model.embed_tokens(ids)  # [T, H]
        for pos, feats in zip(req.image_positions, req.image_features, strict=True):
            embeds[pos : pos + feats.shape[0]] = feats.to(self.device, self.dtype, non_blocking=True)
        return embeds[None]

    @torch.inference_mode()
    def prefill(self, req: Request) -> torch.Tensor:
        """Run the whole prompt; fill the request's cache row; return last logits [1, vocab].

        A request resumed after preemption recomputes its generated tokens too.
        """
        ids = req.prompt_ids + req.output_ids
        t = len(ids)
        positions = self.positions[:t][None]  # [1, T]
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, positions, self.dtype)
        slots = torch.tensor([req.slot], device=self.device)
        logits = self.model(
            self._embed_prompt(req, ids),
            cos,
            sin,
            self.k_cache,
            self.v_cache,
            slots,
            positions,
            t,
            None,
            torch.tensor([t - 1], device=self.device),
        )
        req.computed = t
        return logits

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> torch.Tensor:
        """One token for each request, at its next position; return logits [B, vocab]."""
        b = len(reqs)
        tokens = torch.tensor([r.output_ids[-1] for r in reqs], device=self.device)[:, None]  # [B, 1]
        pos_list = [r.computed for r in reqs]
        positions = torch.tensor(pos_list, device=self.device)[:, None]  # [B, 1]
        kv_len = max(pos_list) + 1
        mask = (self.positions[:kv_len][None, :] <= positions)[:, None, None, :]  # [B, 1, 1, kv_len]
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, positions, self.dtype)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        logits = self.model(
            self.model.embed_tokens(tokens),
            cos,
            sin,
            self.k_cache,
            self.v_cache,
            slots,
            positions,
            kv_len,
            mask,
            torch.zeros(b, dtype=torch.long, device=self.device),
        )
        for r in reqs:
            r.computed += 1
        return logits

    def evict(self, req: Request) -> None:
        """Forget a preempted request's KV state: it resumes by recomputing its prompt and tokens."""
        req.computed = 0

    def own_features(self, req: Request) -> None:
        """Replace features that alias the vision arena by copies (their leases are about to go)."""
        req.image_features = [f.clone() for f in req.image_features]

    @torch.inference_mode()
    def sample(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        """logits [B, vocab] -> one token id per request (one host sync for the batch)."""
        for i, r in enumerate(reqs):
            if len(r.output_ids) < r.sampling.min_tokens:
                logits[i, self.eos] = float("-inf")  # EOS may not end the sequence yet
        if all(r.sampling.greedy for r in reqs):
            return logits.argmax(-1).tolist()
        out = logits.argmax(-1)
        for i, r in enumerate(reqs):
            if r.sampling.greedy:
                continue
            probs = torch.softmax(logits[i] / r.sampling.temperature, dim=-1)
            if r.sampling.top_p < 1.0:
                sorted_p, order = probs.sort(descending=True)
                # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
                drop = sorted_p.cumsum(-1) - sorted_p >= r.sampling.top_p
                sorted_p[drop] = 0.0
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            out[i] = torch.multinomial(probs, 1, generator=r.generator)[0]
        return out.tolist()

    def new_generator(self, seed: int | None) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        return gen
