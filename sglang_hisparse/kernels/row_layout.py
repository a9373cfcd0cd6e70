"""Where a KV row lives in a layer's device buffer: the resolve and replay kernels' row layout.

Host rows are flat (``host_cache`` uint8 [H, I], row ``h`` at ``h * I``) except in
``C4_PAGED_HOST``, whose host pages are the device's. The layouts are a compile-time parameter
of the kernels (``ROWL`` in ``jit_kernels/common.cuh``), whose pure-torch reading and writing
here is the contract:

```
TOKEN     device_cache uint8 [D, I]: row r = bytes [r*I, r*I + I)         DSA (656 / 1152 B),
                                                                          MiniMax-M3 (K then V)
C4_PAGED  device_cache uint8 [pages, 37440]: 64 entries a page,           DeepSeek-V4's C4 KV as
          entry r = page r // 64, e = r % 64:                             FlashMLA reads it
            data  576 B at  e*576                (448 fp8 nope + 128 bf16 rope)
            tail    8 B at  36864 + e*8          (7 ue8m0 scales + 1 pad)
          bytes 37376 .. 37439 of a page: padding (the page is 65 x 576 B)
          host row I = 592 = data | tail | 8 zero bytes (a whole 16-byte piece)
C4_PAGED_HOST  the C4_PAGED device pages, and the host side in the same pages:  DeepSeek-V4 with
          host_cache uint8 [pages, 37440]; a row is still read and written    the host rows SGLang's
          as the 592 bytes above (its 8 padding bytes read 0)               PD transfer writes
KV_SPLIT_HOST  token rows on the device; the host side in halves,            MiniMax-M3 (K then V)
          host_cache uint8 [2H, I/2]: row h's first half (K) at row h,      with the host K and V
          its second (V) at row H + h                                       arrays SGLang's PD
                                                                            transfer writes
```

A C4_PAGED miss therefore moves 36 16-byte pieces to the entry's data and the low 8 bytes of
the 37th to its tail; the host row's last 8 bytes are never stored. The layout is SGLang
0.5.23's (``sglang/kernels/ops/attention/dsv4/kv_layout.py``, read to learn it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["C4_PAGED", "C4_PAGED_HOST", "KV_SPLIT_HOST", "TOKEN", "RowLayout"]


@dataclass(frozen=True)
class RowLayout:
    """``kind`` 0: token rows; 1: paged rows split into a data and a tail piece (``entries``
    per page, ``data`` and ``tail`` bytes each, data of all entries first, then their tails,
    the page padded to ``page`` bytes); 2: those pages on the host side too (``host_paged``);
    3: token rows on the device, host rows split in halves (``host_split``: a host layer is
    uint8 [2H, I/2], row h's halves at rows h and H + h).
    :meth:`read` / :meth:`write` address the device side; :meth:`host_read` /
    :meth:`host_write` the host side, :attr:`device_side` / :attr:`host_side` name each side's
    own layout (what the all-layer row copy takes, which knows kinds 0 and 1)."""

    name: str
    kind: int
    entries: int = 0
    data: int = 0
    tail: int = 0
    page: int = 0

    host_paged: bool = False
    host_split: bool = False

    @property
    def paged(self) -> bool:
        """The device rows are paged (kinds 1 and 2)."""
        return self.kind in (1, 2)

    @property
    def _halves(self) -> bool:
        """This layout addresses split halves itself (the host side of ``KV_SPLIT_HOST``)."""
        return self.kind == 3 and not self.host_split

    @property
    def device_side(self) -> RowLayout:
        return C4_PAGED if self.host_paged else TOKEN if self.host_split else self

    @property
    def host_side(self) -> RowLayout:
        return C4_PAGED if self.host_paged else _SPLIT if self.host_split else TOKEN

    def host_rows_of(self, host_cache: torch.Tensor) -> int:
        """Rows (entries) ``host_cache`` holds."""
        return self.host_side.device_rows(host_cache)

    def host_read(self, host_cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """uint8 [n, host item] of host rows ``rows``."""
        return self.host_side.read(host_cache, rows)

    def host_write(self, host_cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        """``values`` uint8 [n, host item] into host rows ``rows``."""
        self.host_side.write(host_cache, rows, values)

    def host_proxy(self, host_cache: torch.Tensor) -> torch.Tensor:
        """What the token-row shape checks read of ``host_cache``: itself, or for paged or
        split host rows a meta tensor uint8 [host rows, row bytes] (checked here first)."""
        if self.host_paged:
            C4_PAGED.check_device(host_cache, C4_PAGED.host_item())
            return torch.empty((self.host_rows_of(host_cache), self.host_item()), dtype=torch.uint8, device="meta")
        if self.host_split:
            if host_cache.dim() != 2 or host_cache.shape[0] % 2 or host_cache.shape[1] % 16:
                raise ValueError(
                    f"host_cache {tuple(host_cache.shape)} is not the {self.name} layout: uint8 [2H, I/2] with "
                    f"halves of a multiple of 16 bytes (row h's first half at row h, its second at H + h).")
            return torch.empty((host_cache.shape[0] // 2, 2 * host_cache.shape[1]), dtype=torch.uint8, device="meta")
        return host_cache

    @property
    def page_bytes(self) -> int:
        return self.page

    def host_item(self, item: int | None = None) -> int:
        """Bytes of a host row: ``item`` for token rows; data + tail rounded up to 16."""
        if not self.paged:
            if item is None:
                raise ValueError("RowLayout.host_item: token rows need the item size.")
            return item
        return -(-(self.data + self.tail) // 16) * 16

    def device_rows(self, device_cache: torch.Tensor) -> int:
        """Rows (entries) ``device_cache`` holds."""
        if self._halves:
            return device_cache.shape[0] // 2
        return device_cache.shape[0] * (self.entries if self.paged else 1)

    def check_device(self, device_cache: torch.Tensor, item: int) -> None:
        """``device_cache`` is uint8 2-D of this layout for host rows of ``item`` bytes."""
        if device_cache.dtype != torch.uint8 or device_cache.dim() != 2:
            raise ValueError(f"device_cache must be uint8 2-D, got {device_cache.dtype} {tuple(device_cache.shape)}.")
        want = self.page_bytes if self.paged else item
        if device_cache.shape[1] != want or device_cache.stride(1) != 1:
            raise ValueError(
                f"device_cache {tuple(device_cache.shape)} (strides {device_cache.stride()}) is not the "
                f"{self.name} layout: rows of {want} contiguous bytes "
                f"({'one page of ' + str(self.entries) + ' entries' if self.paged else 'one KV row'})."
            )
        if self.paged and item != self.host_item():
            raise ValueError(f"host rows of the {self.name} layout are {self.host_item()} B, got {item}.")

    def proxy(self, device_cache: torch.Tensor, host_cache: torch.Tensor) -> torch.Tensor:
        """What the token-row shape checks read: ``device_cache`` itself for token rows, a meta
        tensor uint8 [device rows, host item] for a paged layout (checked here first)."""
        if not self.paged:
            return device_cache
        item = self.host_item() if self.host_paged else host_cache.shape[1]
        self.check_device(device_cache, item)
        return torch.empty((self.device_rows(device_cache), item), dtype=torch.uint8, device="meta")

    # -- the contract: reading and writing rows ------------------------------------------------
    def _pieces(self, device_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pages = device_cache.shape[0]
        data = device_cache[:, : self.entries * self.data].view(pages, self.entries, self.data)
        tail = device_cache[:, self.entries * self.data : self.entries * (self.data + self.tail)].view(
            pages, self.entries, self.tail)
        return data, tail

    def write(self, device_cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        """``values`` uint8 [n, host item] into device rows ``rows`` (int [n])."""
        rows = rows.to(device=device_cache.device, dtype=torch.int64)
        values = values.to(device_cache.device)
        if self._halves:  # halves at rows h and H + h
            half, H = device_cache.shape[1], device_cache.shape[0] // 2
            device_cache[rows] = values[:, :half]
            device_cache[H + rows] = values[:, half:]
            return
        if not self.paged:
            device_cache[rows] = values
            return
        data, tail = self._pieces(device_cache)
        p, e = rows // self.entries, rows % self.entries
        data[p, e] = values[:, : self.data]
        tail[p, e] = values[:, self.data : self.data + self.tail]

    def read(self, device_cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """uint8 [n, host item] of device rows ``rows``; a paged row's padding bytes read 0."""
        rows = rows.to(device=device_cache.device, dtype=torch.int64)
        if self._halves:
            return torch.cat([device_cache[rows], device_cache[device_cache.shape[0] // 2 + rows]], 1)
        if not self.paged:
            return device_cache[rows]
        data, tail = self._pieces(device_cache)
        p, e = rows // self.entries, rows % self.entries
        out = torch.zeros((rows.numel(), self.host_item()), dtype=torch.uint8, device=device_cache.device)
        out[:, : self.data] = data[p, e]
        out[:, self.data : self.data + self.tail] = tail[p, e]
        return out


TOKEN = RowLayout("token", 0)
#: DeepSeek-V4's C4 compressed KV in FlashMLA's page layout (module docstring)
C4_PAGED = RowLayout("c4_paged", 1, entries=64, data=576, tail=8, page=37440)
#: the same pages on the host side (DeepSeek-V4 served PD: SGLang's transfer writes whole pages)
C4_PAGED_HOST = RowLayout("c4_paged_host", 2, entries=64, data=576, tail=8, page=37440, host_paged=True)
#: MiniMax-M3 served PD: token rows on the device, the host's K and V halves in separate arrays
KV_SPLIT_HOST = RowLayout("kv_split_host", 3, host_split=True)
#: the host side of KV_SPLIT_HOST (what its host layers' tables and reads take)
_SPLIT = RowLayout("kv_split", 3)
