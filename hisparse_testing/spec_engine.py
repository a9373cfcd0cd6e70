"""Speculative (EAGLE / MTP chain) verify steps over :class:`DecodeEngine`.

With ``num_draft_tokens`` W every decode step of a running request is a verify round, driven
with SGLang 0.5.23's EAGLE call order:

```
prefill(req)     allocate_spec_scratch -> core.reserve_spec, then the usual prefill/staging
verify_step()    W logical ids per request for positions s..s+W-1 (alloc() with page_size 1
                 when decode_alloc_rows, like SGLang's alloc_token_slots; else logical only);
                 core.prepare_spec (prepare_spec_verify); num_real_reqs.fill_(bs);
                 per layer: the W tokens' KV written through the mapping, indexer top-k of
                 each verify row j over positions < s+1+j, core.swap_in(req_index,
                 seq_lens [width*W] = s+1+j, top_k [width, W, k]) (dsa_backend target
                 verify), attention of every verify row checked bit for bit; accept lengths
                 a = 0..W-1 drawn at random; core.commit_spec(accept_index [bs, W] with rows
                 b*W+0..b*W+a, -1 padded); the rejected drafts' logical ids are freed
```

Every round writes the window's KV with a fresh *salt* (:meth:`ToyModel.kv_salted`): a
rejected draft's bytes differ from whatever a later round computes at the same position, so
a window row leaking into history, or an accepted token not written through, is a mismatch.
The oracle reads, per position, the salt of the round that accepted it (0 for prompts;
re-prefill after a retraction recomputes salt-0 KV and resets them).
"""

from __future__ import annotations

import random

import torch

from hisparse_testing.engine import DecodeEngine, Mismatch, ToyRequest


class SpecDecodeEngine(DecodeEngine):
    """A :class:`DecodeEngine` whose :meth:`step` is a speculative verify round (see the module
    docstring). ``num_draft_tokens`` W >= 1 (W = 1: one verify row, the MTP chain of one draft).
    Any page size: with pages > 1 a rejected draft's id in the page of the last accepted token
    stays the request's (SGLang keeps the partly used page; the next round's alloc_extend
    continues in it) and only pages past it are freed."""

    def __init__(self, *args, num_draft_tokens: int, accept_seed: int = 0, **kwargs) -> None:
        super().__init__(*args, num_draft_tokens=num_draft_tokens, **kwargs)
        if num_draft_tokens < 1:
            raise ValueError(f"SpecDecodeEngine: num_draft_tokens = {num_draft_tokens} must be >= 1.")
        self.W = num_draft_tokens
        self.salts: dict[int, list[int]] = {}
        self.rounds = 0  # verify steps
        self.verified = 0  # (request, round) pairs
        self.accepted = 0  # tokens committed by verify rounds
        self.accept_rng = random.Random(accept_seed)

    # -- admission: margins for the window, salts reset -----------------------------------------
    def can_admit(self, req: ToyRequest) -> bool:
        W, n, ps = self.W, req.prompt_len, self.sizes.page_size
        if not self.free_slots or n + req.max_new - req.generated + W > self.sizes.max_ctx:
            return False
        window = -(-W // ps) * ps + ps  # a window's ids/rows, page-rounded, crossing one more page
        need = (min(n, self.sizes.buffer_size) + 1 if req.direct else n) + window
        return (
            self.allocator.logical.available_size() >= n + ps + window * self.sizes.num_reqs
            and self.allocator.rows.available_size() >= need + self.sizes.num_reqs * (2 * window + ps)
        )

    def decode_demand(self, batch: list[ToyRequest]) -> tuple[int, int]:
        """A verify round: the window's new pages of logical ids; rows as ``can_admit`` reserves
        them per request (the temporary ``alloc()`` rows and the window's hot-buffer rows)."""
        W, ps = self.W, self.sizes.page_size
        ids = sum(-(-(q.seq_len + W) // ps) * ps - -(-q.seq_len // ps) * ps for q in batch)
        window = -(-W // ps) * ps + ps
        return ids, len(batch) * (2 * window + ps)

    def prefill(self, req: ToyRequest, *, defer: bool = False) -> None:
        self.core.reserve_spec([self.free_slots[0]])  # allocate_spec_scratch
        super().prefill(req, defer=defer)
        self.salts[req.rid] = [0] * req.prompt_len

    def admit_direct(self, req: ToyRequest) -> None:
        super().admit_direct(req)
        self.salts[req.rid] = [0] * req.prompt_len

    # -- one verify round --------------------------------------------------------------------------
    def step(self, pad_to: int | None = None) -> None:
        batch = list(self.running)
        if not batch:
            return
        dev, bs, W = self.device, len(batch), self.W
        s_cpu = [q.seq_len for q in batch]
        r_cpu = [q.req_pool_idx for q in batch]
        if self.decode_alloc_rows:
            ids = self.allocator.alloc(bs * W)
        else:
            last = self.req_to_token[torch.tensor(r_cpu), torch.tensor(s_cpu) - 1]
            ids = self.allocator.alloc_logical_extend(
                torch.tensor(s_cpu), torch.tensor(s_cpu) + W, last
            )
        if ids is None:
            raise RuntimeError("verify_step: logical ids exhausted (can_admit should have refused)")
        ids = ids.to(dev)
        for b, (r, s) in enumerate(zip(r_cpu, s_cpu, strict=True)):
            self.req_to_token[r, s : s + W] = ids[b * W : (b + 1) * W]
        req_index = torch.tensor(r_cpu, dtype=torch.int64, device=dev)
        self.core.prepare_spec(
            req_index=req_index, req_index_cpu=r_cpu, seq_lens_cpu=s_cpu, out_cache_loc=ids,
            out_cache_loc_cpu=ids.cpu() if self.rounds % 2 else None,
        )
        self.core.num_real_reqs.fill_(bs)
        width = max(pad_to or bs, bs)
        s_pad = torch.tensor(s_cpu + [0] * (width - bs), dtype=torch.int64, device=dev)
        r_pad = torch.cat([req_index, torch.zeros(width - bs, dtype=torch.int64, device=dev)])
        # dsa_seqlens_expanded: row j of a request with s committed tokens has length s+1+j
        lens = (s_pad[:, None] + 1 + torch.arange(W, device=dev)).reshape(-1)
        salt = self.rounds + 1
        self._verify_forward(batch, r_pad, lens, ids, width, salt)
        accept = [min(self.accept_rng.randrange(W), q.max_new - q.generated - 1) for q in batch]
        acc = torch.full((bs, W), -1, dtype=torch.int32)
        for b, a in enumerate(accept):
            acc[b, : a + 1] = torch.arange(b * W, b * W + a + 1, dtype=torch.int32)
        self.core.commit_spec(acc.to(dev), validate=True)
        ps = self.sizes.page_size
        for b, (q, a) in enumerate(zip(batch, accept, strict=True)):
            r, s = q.req_pool_idx, q.seq_len
            rejected = ids[b * W + a + 1 : (b + 1) * W]
            kept_page = int(ids[b * W + a]) // ps
            rejected = rejected[rejected // ps != kept_page]  # whole pages past the accepted token
            if rejected.numel():
                self.allocator.free(rejected)
            self.req_to_token[r, s + a + 1 : s + W] = 0
            self.salts[q.rid] += [salt] * (a + 1)
            q.seq_len += a + 1
            q.generated += a + 1
            self.accepted += a + 1
        if self.core.spec is not None:
            self.core.spec.check_integrity()
        self.rounds += 1
        self.verified += bs
        self.steps += 1

    def _verify_forward(self, batch, req_index, lens, ids, width, salt) -> None:
        m, dev, bs, W = self.model, self.device, len(batch), self.W
        top_k = torch.full((width, W, m.top_k), -1, dtype=torch.int32, device=dev)
        for layer in range(m.num_layers):
            kv = self.pool.layer(layer)
            for b, q in enumerate(batch):  # set_kv_buffer of the W verify tokens (this round's salt)
                pos = torch.arange(q.seq_len, q.seq_len + W, device=dev)
                mine = ids[b * W : (b + 1) * W]
                self.pool.write(layer, mine, m.kv_salted(q.seed, pos, torch.full((W,), salt), layer))
                if not m.shared[layer]:
                    self.pool.write_index(layer, mine, m.index_keys(q.seed, pos, layer).view(torch.uint8))
                    for j in range(W):
                        row_ids = self.req_to_token[q.req_pool_idx, : q.seq_len + 1 + j]
                        keys = self.pool.read_index(layer, row_ids).view(torch.float32)
                        top_k[b, j] = m.select(keys, q.seed, layer)
            rows = self.core.swap_in(req_index, lens, top_k, layer)
            if tuple(rows.shape) != (width, W, m.top_k):
                raise Mismatch(f"layer {layer}: swap_in returned {tuple(rows.shape)}, want {(width, W, m.top_k)}")
            if not self.check:
                continue
            if bool((rows[bs:] != -1).any()):
                raise Mismatch(f"layer {layer}: padding requests resolved to {rows[bs:].tolist()}")
            valid = top_k[:bs] >= 0
            if not torch.equal(valid, rows[:bs] >= 0):
                raise Mismatch(f"layer {layer}: -1 pattern of rows differs from top_k")
            got = m.attend(kv[rows[:bs].clamp(min=0).long()].reshape(bs * W, m.top_k, -1), valid.reshape(bs * W, -1))
            want_bytes = []
            for b, q in enumerate(batch):
                pos = top_k[b].clamp(min=0).long()
                hist = torch.tensor(self.salts[q.rid] + [salt] * W, dtype=torch.int64)
                salts = hist[pos.cpu().reshape(-1)]
                want_bytes.append(m.kv_salted(q.seed, pos.reshape(-1), salts, layer).view(W, m.top_k, -1))
            want = m.attend(torch.cat(want_bytes).reshape(bs * W, m.top_k, -1), valid.reshape(bs * W, -1))
            if not torch.equal(got, want):
                bad = sorted({batch[i // W].rid for i in range(bs * W) if not torch.equal(got[i], want[i])})
                raise Mismatch(f"verify round {self.rounds} layer {layer}: attention differs for requests {bad}")
            self.checked_outputs += bs * W

    def check_no_leaks(self) -> None:
        super().check_no_leaks()
        spec = self.core.spec
        if spec is not None and (any(spec.active) or spec._round is not None):
            raise AssertionError("leaks after all requests ended: verify windows still active")
