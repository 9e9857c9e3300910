"""The generation cache: what each attention layer keeps of the tokens it has seen, so that a
decode step runs the new token alone (titanlite.generate).

A batch of prompts of different lengths is left-padded to one length: row b's real tokens start
at slot `start[b]`, and every row's token t sits in slot t, so one forward serves the whole
batch. The pads of a row form a document of their own: no real token sees a pad (nor a pad a
real token), in softmax attention (`mask`) as in the linear layers' state and convolution
(`starts`), so a prompt's outputs are those it has alone.

Each attention kind owns what it stores through `extend` (tensors that grow with the sequence,
in a ring of `window` slots for a sliding layer) and `state` (a fixed-size state, the gated
delta rule's): softmax attention keeps its keys and values (titanlite.layers.attention), MLA its
compressed latent and RoPE key (DeepSeek-V3), Gated DeltaNet its recurrent state and the
convolution's last inputs. The model's forward reaches it through AttnContext.past.
"""

from __future__ import annotations

from typing import Any

import torch


class Cache:
    """Every layer's past for one batch of `start.shape[0]` rows and at most `capacity` tokens
    per row (pads included). After each forward the caller moves `length` on by the tokens it
    fed (`advance`), so a layer sees the slot of its first new token as `length`."""

    def __init__(self, start: torch.Tensor, capacity: int):
        self.start = start
        """[B] slot of each row's first real token (the pads before it: left padding)."""
        self.capacity = capacity
        self.length = 0
        self._slots: dict[int, dict[str, torch.Tensor]] = {}
        self._index: dict[int, torch.Tensor] = {}
        self._states: dict[int, dict[str, torch.Tensor]] = {}

    def advance(self, n: int) -> None:
        """The tokens of the forward just run are now past."""
        self.length += n

    def new_index(self, n: int) -> torch.Tensor:
        """[n] slots of the tokens this forward feeds."""
        return torch.arange(self.length, self.length + n, device=self.start.device)

    def extend(self, owner: object, window: int | None, dim: int = 1, **new: torch.Tensor
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Store `new` (tensors with this forward's tokens along `dim`) as `owner`'s past, and
        return, per name, the past before them joined with them, and the slot of each entry
        ([T]; -1: an empty ring slot). Without a window the past is every token, in a buffer
        of `capacity`; with one, a ring of `window` slots (slot t % window) that keeps what the
        next query can see."""
        n = next(iter(new.values())).shape[dim]
        index = self.new_index(n)
        key = id(owner)
        size = self.capacity if window is None else min(window, self.capacity)
        if key not in self._slots:
            self._slots[key] = {name: _empty(x, dim, size) for name, x in new.items()}
            self._index[key] = torch.full((size,), -1, dtype=torch.long, device=self.start.device)
        slots, slot_index = self._slots[key], self._index[key]
        if window is None:
            for name, x in new.items():
                slots[name].narrow(dim, self.length, n).copy_(x)
            slot_index[self.length:self.length + n] = index
            end = self.length + n
            return {name: s.narrow(dim, 0, end) for name, s in slots.items()}, slot_index[:end]
        # a ring: the new queries read the ring as it was and the new entries, then the ring keeps
        # the last `size` of those
        seen = {name: torch.cat([slots[name], x], dim=dim) for name, x in new.items()}
        seen_index = torch.cat([slot_index, index])
        keep = min(n, size)
        where = index[n - keep:] % size
        for name, x in new.items():
            slots[name].index_copy_(dim, where, x.narrow(dim, n - keep, keep))
        slot_index[where] = index[n - keep:]
        return seen, seen_index

    def mask(self, key_index: torch.Tensor, n: int, window: int | None) -> torch.Tensor:
        """[B, 1, n, T]: which of the keys at slots `key_index` ([T]) each of this forward's n
        queries sees: itself and before, inside the window, on its own side of the row's start
        (real tokens see real ones; pads, which no real token reads, see pads)."""
        q = self.new_index(n)[:, None]
        k = key_index[None, :]
        visible = (k >= 0) & (k <= q)
        if window is not None:
            visible = visible & (q - k < window)
        start = self.start[:, None, None]
        same_side = (q[None] >= start) == (k[None] >= start)
        return (visible[None] & same_side)[:, None]

    def starts(self, first: int, n: int) -> torch.Tensor:
        """[B, n] True at the slot where a row's real tokens start, over slots [first, first + n)
        (the linear layers' document starts: their state and convolution restart there)."""
        return torch.arange(first, first + n, device=self.start.device)[None] == self.start[:, None]

    def positions(self, n: int) -> torch.Tensor:
        """[B, n] RoPE positions of this forward's tokens: 0 at each row's first real token (pads 0)."""
        return (self.new_index(n)[None] - self.start[:, None]).clamp(min=0)

    def select(self, rows: torch.Tensor) -> Cache:
        """A cache of the given rows of this one ([R] row indices, repeats allowed), at the same
        length: several continuations of one prompt each read its past from here on (scoring a
        multiple-choice question's choices after one forward of its context)."""
        out = Cache(self.start[rows], self.capacity)
        out.length = self.length
        out._slots = {k: {name: t.index_select(0, rows) for name, t in d.items()} for k, d in self._slots.items()}
        out._index = {k: t.clone() for k, t in self._index.items()}
        out._states = {k: {name: t.index_select(0, rows) for name, t in d.items()} for k, d in self._states.items()}
        return out

    def state(self, owner: object) -> dict[str, torch.Tensor]:
        """`owner`'s fixed-size state, which it reads and replaces (empty at first)."""
        return self._states.setdefault(id(owner), {})

    def nbytes(self) -> int:
        """Bytes the cache holds: every layer's stored tensors and states."""
        tensors = [t for d in (*self._slots.values(), *self._states.values()) for t in d.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def cache_bytes(args: Any, batch: int, tokens: int, itemsize: int = 4, tp: int = 1) -> int:
    """What `Cache.nbytes` holds for `batch` rows of `tokens` slots (prompt and generated tokens,
    pads included) of a model of `args` (a family's ModelArgs), on each of `tp` tensor-parallel
    ranks: per token and layer, softmax attention keeps 2 x n_kv_heads / tp x head_dim values (a
    sliding layer for at most `window` tokens); MLA (args with kv_lora_rank) kv_lora_rank +
    qk_rope_head_dim, whole on every rank (its down projection is not split); a Gated DeltaNet layer
    keeps a [v_heads / tp, k_head_dim, v_head_dim] state in float32 and the last conv_kernel - 1
    inputs of its q, k and v channels (split as the heads), whatever the length. The rest is in the
    model's dtype, of `itemsize` bytes."""
    total = 0
    for layer in range(args.n_layers):
        if getattr(args, "kv_lora_rank", 0):
            total += tokens * (args.kv_lora_rank + args.qk_rope_head_dim) * itemsize
        elif hasattr(args, "layer_type") and args.layer_type(layer) == "linear_attention":
            channels = 2 * args.linear_k_heads * args.linear_k_head_dim + args.linear_v_heads * args.linear_v_head_dim
            total += (args.linear_v_heads * args.linear_k_head_dim * args.linear_v_head_dim * 4
                      + (args.conv_kernel - 1) * channels * itemsize) // tp
        else:
            kept = min(tokens, args.window(layer) or tokens)
            total += kept * 2 * args.n_kv_heads // tp * args.head_dim * itemsize
    return total * batch


def _empty(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = size
    return x.new_zeros(shape)
