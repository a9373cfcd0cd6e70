"""Per-request hot-buffer state: the named tensors the resolve kernel reads and writes.

Shapes (per TP rank; ``L`` local sparse layers, ``R`` request slots, ``B`` hot slots, ``W``
slots past the history: 1 (slot B, the newest token) without speculative decoding, the verify
window of ``num_draft_tokens`` with it):

```
slot_tokens    [L, R, B+W] int32   logical position held by each slot, -1 empty;
                                   slot B = the newest token once n > B
slot_rows      [R, B+W]    int32   device KV row behind each slot, -1 = no row held
                                   (same rows for every layer: KV arrays are per layer)
lru            [L, R, B]   int16   slot ids 0..B-1, oldest -> newest
resident       [L, R, P/32] int32  resident hint: bit p set iff a slot < B holds position p
                                   (P = host pool columns; None under speculative decoding,
                                   whose verify kernel does not read it, even at W = 1)
policy_state   [L, R, S]   int32   the replacement policy's state (kernel_policy.state_width):
                                   "fra" S = B, a word per history slot (hits and last
                                   selection); "slru" S = 1, its level boundaries; None for
                                   "lru". Zero for a fresh request: its slots never selected
res_flag       [R]          int32  1 = fully resident request ("residency": "pressure"):
                                   every position has a device row, slot state unused
res_pages      [R, P/ps]    int32  its device page per ps positions, -1 none
res_ring       [1]          int32  the selection-record block this step (ResidentRows)
```

The last three exist only with residency (``residency_page_size`` > 0); a resident request's
``slot_tokens`` history holds the record of its recent selections instead of slots
(``kernels.contract.ResidentRows``), which a shrink to a hot buffer reads.

The resident hint lets the resolve kernel start fetching probable misses before its
bookkeeping ends (``kernels.reference`` says what it means). The kernel keeps it in step with
``slot_tokens``; so do ``reset``, ``install`` and the short-request growth in
``coordinator.step``. A wrong bit costs time, never a wrong row.

``num_draft_tokens`` (SGLang's ``speculative_num_draft_tokens``, 0 = off) is carried here and
nowhere else: the slot width, the hint, the resolver's mode and the ``SpecWindow`` all derive
from it. With it, W = num_draft_tokens and slots ``B..B+W-1`` are the verify window
(``coordinator.spec``; the single-row ``map_last_loc``/``resolve`` path is not used then).

A request's slots, as it grows (``n`` = tokens, ``B`` = 4):

```
n=3 (short)   slots 0 1 2 . | .     token p in slot p, newest included; rows held = n
n=4           slots 0 1 2 3 | .
n=5 (grown)   slots 0 1 2 3 | 4     first growth past B: slot B gets a row, LRU s0..s3
n=9           slots a b c d | 8     a..d = whatever the LRU kept; slot B = token n-1
```

Device bytes per request slot (these tensors plus the host pool's ``host_rows`` row):
``state_bytes.slot_state_bytes``, which the capacity planner counts.

Host-side bookkeeping (Python lists, indexed by request slot) records what the host needs
to decide without reading device memory: the phase, the current length and whether the next
decode step may skip the write-through backup. The device rows a request holds follow from
its length (:meth:`SlotState.history_rows`, :meth:`SlotState.rows_held`), so no count of them
is kept. ``seq_len`` is the length the slots cover: decode, the tokens including the newest
(being written this step); speculative decoding, ``s + W`` once a verify round over positions
``s..s+W-1`` is prepared (the admitted length before the first).
"""

from __future__ import annotations

import enum

import torch

from ..kernel_policy import VERIFY_POLICIES, state_width
from ..kernels.contract import ResidentRows
from ..kernels.reference import position_bits
from ..memory.state_bytes import hint_words, residency_columns, tail_slots


class Phase(enum.Enum):
    FREE = "free"
    STAGING = "staging"  # prompt KV being copied device -> host; not decodable yet
    DECODING = "decoding"  # hot buffer in place; map_last_loc/swap_in apply


class SlotState:
    """The state tensors above plus host-side bookkeeping; no policy lives here."""

    def __init__(
        self, *, num_layers: int, num_reqs: int, buffer_size: int, device: torch.device,
        num_draft_tokens: int = 0, hint_positions: int = 0, residency_page_size: int = 0,
        policy: str = "lru",
    ) -> None:
        if num_draft_tokens < 0:
            raise ValueError(
                f"num_draft_tokens = {num_draft_tokens} must be >= 0 (0 = no speculative decoding)."
            )
        self.num_layers = num_layers
        self.num_reqs = num_reqs
        self.buffer_size = buffer_size
        #: W verify rows per request, 0 without speculative decoding (module docstring)
        self.num_draft_tokens = num_draft_tokens
        self.device = torch.device(device)
        B, width = buffer_size, buffer_size + tail_slots(num_draft_tokens)
        self.slot_tokens = torch.full(
            (num_layers, num_reqs, width), -1, dtype=torch.int32, device=self.device
        )
        self.slot_rows = torch.full((num_reqs, width), -1, dtype=torch.int32, device=self.device)
        self._lru_init = torch.arange(B, dtype=torch.int16, device=self.device)
        self.lru = self._lru_init.expand(num_layers, num_reqs, B).clone()
        #: resident hint (see module docstring); only for single-row decode with a host pool
        #: of ``hint_positions`` columns
        self.resident: torch.Tensor | None = None
        if words := hint_words(max_context=hint_positions, num_draft_tokens=num_draft_tokens):
            self.resident = torch.zeros(
                (num_layers, num_reqs, words), dtype=torch.int32, device=self.device
            )
        #: the replacement policy and its per-slot words (module docstring)
        self.policy = policy
        self.policy_state: torch.Tensor | None = None
        if pwidth := state_width(policy, B):
            if num_draft_tokens and policy not in VERIFY_POLICIES:
                raise ValueError(
                    f"policy {policy!r} with speculative decoding: the verify kernel implements "
                    f"{' and '.join(repr(p) for p in VERIFY_POLICIES)} only; use one of those or "
                    f"num_draft_tokens = 0."
                )
            self.policy_state = torch.zeros(
                (num_layers, num_reqs, pwidth), dtype=torch.int32, device=self.device
            )
        #: fully resident requests' page tables (see the module docstring), or None
        self.resident_rows: ResidentRows | None = None
        if cols := residency_columns(max_context=hint_positions, page_size=residency_page_size):
            self.resident_rows = ResidentRows(
                flag=torch.zeros(num_reqs, dtype=torch.int32, device=self.device),
                pages=torch.full((num_reqs, cols), -1, dtype=torch.int32, device=self.device),
                page_size=residency_page_size,
                ring=torch.zeros(1, dtype=torch.int32, device=self.device),
            )
        #: the last decode batch mapped (``map_last_loc``) is all resident: its resolves copy
        #: nothing, so the resolver may skip the replays (host-side, never inside a capture)
        self.batch_all_resident = False
        # Host-side bookkeeping, one entry per request slot.
        self.phase = [Phase.FREE] * num_reqs
        #: fully resident (``res_flag`` on the host; rows follow from the page table)
        self.is_resident = [False] * num_reqs
        self.seq_len = [0] * num_reqs
        self.skip_backup = [False] * num_reqs

    @property
    def speculative(self) -> bool:
        """Every decode step is a verify step of ``num_draft_tokens`` rows."""
        return self.num_draft_tokens > 0

    # -- rows held, derived from the length ---------------------------------------------
    def history_rows(self, r: int) -> int:
        """History slots ``0..h-1`` of request ``r`` that hold a device row: ``min(seq_len, B)``
        once it decodes (a short request's token p sits in slot p; a long one fills them all)."""
        if self.phase[r] is not Phase.DECODING:
            return 0
        return min(self.seq_len[r], self.buffer_size)

    def rows_held(self, r: int) -> int:
        """Device rows request ``r``'s slots hold: the history rows plus slot B once
        ``seq_len > B`` or, under speculative decoding, the W window rows (which
        ``SpecWindow.admit`` adds right after the install)."""
        if self.phase[r] is not Phase.DECODING:
            return 0
        tail = self.num_draft_tokens if self.speculative else int(self.seq_len[r] > self.buffer_size)
        return self.history_rows(r) + tail

    # -- whole-request transitions ------------------------------------------------------
    def reset(self, r: int) -> None:
        """Forget request slot ``r`` (its rows must already be returned)."""
        self.slot_tokens[:, r].fill_(-1)
        self._clear_slots(r)
        if self.is_resident[r]:
            self.clear_resident(r)
        self.phase[r] = Phase.FREE
        self.seq_len[r] = 0
        self.skip_backup[r] = False

    def install_resident(self, r: int, pages: list[int], seq_len: int) -> None:
        """Make request ``r`` of length ``seq_len`` fully resident over device ``pages`` (its
        page table, in position order). A request new to decoding has every token on host
        (staged or transferred), so its next step skips the write-through of the newest."""
        rr = self.resident_rows
        if rr is None:
            raise ValueError("install_resident: this state was built without residency (residency_page_size = 0).")
        rr.pages[r].fill_(-1)
        rr.pages[r, : len(pages)] = torch.tensor(pages, dtype=torch.int32).to(self.device, non_blocking=True)
        rr.flag[r : r + 1].fill_(1)
        # The history slots become the selection record: nothing recorded yet.
        self.slot_tokens[:, r].fill_(-1)
        self.is_resident[r] = True
        if self.phase[r] is not Phase.DECODING:
            self._clear_slots(r)
            self.skip_backup[r] = True
        self.seq_len[r] = seq_len
        self.phase[r] = Phase.DECODING

    def _clear_slots(self, r: int) -> None:
        """Slot rows, LRU order, resident hint and policy words of ``r`` back to empty."""
        self.slot_rows[r].fill_(-1)
        self.lru[:, r].copy_(self._lru_init)
        if self.resident is not None:
            self.resident[:, r].zero_()
        if self.policy_state is not None:
            self.policy_state[:, r].zero_()

    def set_resident_page(self, r: int, index: int, page: int) -> None:
        """Page ``index`` of resident request ``r``'s table (a new page as it grows)."""
        assert self.resident_rows is not None
        # NOTE: fill_ of a view, not an item assignment: assigning a Python number to an
        # element copies it host->device and blocks (this runs inside map_last_loc)
        self.resident_rows.pages[r, index : index + 1].fill_(page)

    def clear_resident(self, r: int) -> None:
        """Request ``r`` is no longer fully resident (shrunk or released)."""
        if self.resident_rows is not None:
            self.resident_rows.flag[r : r + 1].fill_(0)
            self.resident_rows.pages[r].fill_(-1)
        self.is_resident[r] = False

    def install(self, r: int, rows: torch.Tensor, seq_len: int, *, resident: bool) -> None:
        """Give request ``r`` of length ``seq_len`` its hot buffer ``rows`` (int32 device).

        ``rows`` has ``min(seq_len, B)`` entries for a short request and ``B + 1`` for a long
        one (slot ``B`` last). ``resident``: the rows already hold the KV of tokens
        ``0..min(n, B)-1`` (and slot B the newest token); when false (PD direct admission of
        a long request) slots 0..B-1 start empty so the first step misses everything.
        """
        B = self.buffer_size
        n_rows = rows.numel()
        if n_rows != min(seq_len, B) + int(seq_len > B):
            raise ValueError(
                f"install: request slot {r} of length {seq_len} got {n_rows} hot rows; a hot buffer "
                f"of B = {B} slots holds min(n, B) rows, plus slot B's once n > B."
            )
        self.slot_rows[r].fill_(-1)
        self.slot_rows[r, :n_rows] = rows.to(torch.int32)
        self.lru[:, r].copy_(self._lru_init)
        if self.policy_state is not None:
            self.policy_state[:, r].zero_()
        self.slot_tokens[:, r].fill_(-1)
        if seq_len <= B:
            if resident:
                self.slot_tokens[:, r, :seq_len] = torch.arange(
                    seq_len, dtype=torch.int32, device=self.device
                )
        else:
            if resident:
                self.slot_tokens[:, r, :B] = torch.arange(B, dtype=torch.int32, device=self.device)
            self.slot_tokens[:, r, B] = seq_len - 1
        if self.resident is not None:
            held = torch.arange(min(seq_len, B) if resident else 0, device=self.device)
            self.resident[:, r] = position_bits(held, self.resident.shape[2])
        self.seq_len[r] = seq_len
        self.phase[r] = Phase.DECODING
        # The host already has every token up to seq_len - 1 (staged or transferred).
        self.skip_backup[r] = True
