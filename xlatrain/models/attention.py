"""Attention on [batch, length, heads, head dim], formulated for the platform it runs on.

- GPU, bf16/f16: cuDNN's fused (flash) attention where cuDNN takes the shapes. jax's default is XLA's, which
  writes the [length, length] scores and their mask to memory (GPT-2 small's attention on an H200, forward and
  backward: 3.35 ms per layer, cuDNN's 0.67 ms; bench.gpu).
- CPU, causal: in query blocks. XLA's attention computes every query-key product and masks the future. Cut
  into n blocks of consecutive queries, block i attends only the keys up to its own last query, so the blocks
  above the diagonal are never computed: n(n+1)/2 of n^2 blocks of products (10/16 at n = 4), as a flash kernel
  (PyTorch's CPU one included) skips them. Alone, forward and backward: 0.65x the dense attention's time at
  length 128, 0.45x at 256, 0.49x at 1024. In the 4 x 256 GPT's train step at length 128, where the dense
  attention takes a fifth of the time, the step took 0.91-1.01x the dense one's (median 0.95, ten in-process
  A/B runs; 0.99x and 0.92x in bench.cpu_speed); at length 64 (the default GPT), in two blocks of 32 queries:
  0.95-0.97x four blocks of 16 in three in-process A/B runs on the Intel host (four blocks: 0.95-1.00x dense on
  the AMD host; dense 0.98-1.01x four blocks on the Intel host).
- CPU, float16: float32 and back, since XLA:CPU has no float16 x float16 -> float32 dot (the precision jax asks
  for with f16 inputs).
- Packed documents (segment ids): a position attends only the earlier positions of its own document. Each block's
  mask is built from its slice of the segment ids: on CPU each query block's; up to BLOCKWISE_AFTER tokens the
  whole [batch, length, length] one, given to cuDNN's fused attention (jax turns it into the bias that kernel
  takes: the fused path stays, at the cost of reading that bias) and to XLA's.
- Longer self-attention (past BLOCKWISE_AFTER tokens, a length that 128 divides) on XLA's path runs blockwise
  (xlatrain/models/blockwise.py: pairs of query and key blocks with an online softmax, FlashAttention's forward and
  backward written in XLA's ops), so that no [length, length] array of scores or mask exists; on GPUs cuDNN's
  fused kernel (which holds no such array either) where it takes the inputs, and blockwise for packed documents,
  whose mask it would take whole.
- Sliding windows (a query at i attends the keys j with i - W < j <= i, as transformers 5 defines them): cuDNN's
  fused attention takes the window (`local_window_size`); on CPU the query blocks are at least a window long and
  each reads only the keys its window reaches, so the products wholly outside every window are never computed;
  XLA's attention otherwise, with the window in its mask. A window at least as long as the sequence is full
  causal attention. Packed documents' segments apply inside the window.
- Soft-capped scores (Gemma 2: tanh(s / c) c): written out in XLA's ops (`dot_attention`), since neither
  jax.nn.dot_product_attention nor cuDNN's fused kernel caps them; the query blocks and windows apply as above.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

import jax
import jax.numpy as jnp

from xlatrain.compat.backends import cudnn_missing
from xlatrain.errors import first_line
from xlatrain.models.blockwise import Visibility, blockwise_attention, sees
from xlatrain.models.context import current_context_group, local_attention, sequence_split_attention, token_places
from xlatrain.runtime.platform import lowering_platform
from xlatrain.sharding import context_split

QUERY_BLOCKS_AT_MOST = 4
"""More blocks skip more products but run more, smaller kernels; past 4 the step got no faster on CPU."""
QUERY_BLOCK_ROWS_AT_LEAST = 32
"""Blocks of 16 queries were slower than blocks of 32 at length 64: their kernels are too small (module doc)."""


INSTALL_CUDNN = "pip install nvidia-cudnn-cu13 beside jax's CUDA plugin"


def fused_attention_missing(platform: str, compute: jnp.dtype) -> str | None:
    """Where attention() would take cuDNN's fused kernel but cannot, because cuDNN is not installed: what falls back
    and what to install (a run's one warning); None elsewhere."""
    if platform != "gpu" or compute not in (jnp.bfloat16, jnp.float16):
        return None
    missing = cudnn_missing()
    if missing is None:
        return None
    return (f"attention falls back to XLA's, not cuDNN's fused kernel ({missing}): about 5x slower in the forward "
            f"and backward (bench.gpu); {INSTALL_CUDNN}")


@dataclass(frozen=True)
class AttentionPath:
    """Which kernel an attention of some layers was traced into, for `xlatrain lower`'s report."""

    window: int | None
    """The layers' sliding window (None: full attention)."""
    softcap: float | None
    kernel: str
    """`cuDNN's fused kernel`, `XLA's` or `XLA's, in N query blocks` (CPU)."""
    why: str = ""
    """Why not cuDNN's, on a GPU ("" otherwise)."""


_traced_paths: contextvars.ContextVar[list[AttentionPath] | None] = contextvars.ContextVar("attention_paths",
                                                                                            default=None)


@contextlib.contextmanager
def attention_paths() -> Iterator[list[AttentionPath]]:
    """The paths the attentions traced inside the block take, each once, in the order first traced."""
    paths: list[AttentionPath] = []
    token = _traced_paths.set(paths)
    try:
        yield paths
    finally:
        _traced_paths.reset(token)


def _took(window: int | None, softcap: float | None, kernel: str, why: str = "") -> None:
    paths, path = _traced_paths.get(), AttentionPath(window, softcap, kernel, why)
    if paths is not None and path not in paths:
        paths.append(path)


BLOCKWISE_AFTER = 1024
"""Self-attention over more tokens runs blockwise (xlatrain/models/blockwise.py): no array of [length, length]
scores or mask; up to it, one block of scores of at most 1024 x 1024 per head is the largest."""
BLOCKWISE_BLOCKS = (512, 256, 128)
"""Queries and keys per block of the blockwise attention, the first that divides the length."""
WINDOWED_QUERY_BLOCKS_AT_MOST = 16
"""Sliding windows: blocks of at least a window's length, each reading under two windows of keys, up to this many."""


def query_blocks(length: int, window: int | None = None) -> int:
    """How many equal blocks of queries a causal attention over `length` positions runs in on CPU: the most,
    up to QUERY_BLOCKS_AT_MOST, that divide the length into blocks of QUERY_BLOCK_ROWS_AT_LEAST rows or more; with
    a sliding `window`, up to WINDOWED_QUERY_BLOCKS_AT_MOST blocks of at least the window's length too."""
    most, rows = ((QUERY_BLOCKS_AT_MOST, QUERY_BLOCK_ROWS_AT_LEAST) if window is None else
                  (WINDOWED_QUERY_BLOCKS_AT_MOST, max(QUERY_BLOCK_ROWS_AT_LEAST, window)))
    fitting = [n for n in range(1, most + 1) if length % n == 0 and length // n >= rows]
    return max(fitting, default=1)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None,
                     window: int | None = None, scale: float | None = None, softcap: float | None = None,
                     positions: jax.Array | None = None) -> jax.Array:
    """`segment_ids` [batch, length]: packed documents, each attending only itself (None: one sequence per row).
    `window`: each query attends its `window` latest keys, itself included (None: every earlier key). `scale`: of
    the scores (None: 1 / sqrt(head width)). `softcap`: scores soft-capped to (-c, c) as tanh(s / c) c (Gemma 2).
    `positions` [batch, length]: each token's position in its document, which orders attention where the row is
    not in the tokens' order (context parallelism's balanced chunks); unused otherwise."""
    return attention(q, k, v, is_causal=True, segment_ids=segment_ids, window=window, scale=scale, softcap=softcap,
                     positions=positions)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, is_causal: bool, scale: float | None = None,
              segment_ids: jax.Array | None = None, window: int | None = None, softcap: float | None = None,
              positions: jax.Array | None = None) -> jax.Array:
    """Under jax.named_scope('attention'): the compiled step's attention kernels carry its name (profiles' traces;
    lowering.kernels.matmul_flops_in counts their FLOPs)."""
    with jax.named_scope("attention"):
        return _attention(q, k, v, is_causal=is_causal, scale=scale, segment_ids=segment_ids, window=window,
                          softcap=softcap, positions=positions)


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, *, is_causal: bool, scale: float | None,
               segment_ids: jax.Array | None, window: int | None, softcap: float | None,
               positions: jax.Array | None) -> jax.Array:
    split, group = context_split(), current_context_group()
    whole = k.shape[1] if group is None else k.shape[1] * group.size  # a per-device program holds a part
    window = None if window is None or window >= whole else window
    if split is not None or group is not None:
        if not is_causal or positions is None:
            raise ValueError("context parallelism splits causal self-attention whose tokens carry their positions")
        visibility = Visibility(True, window, _scale(q, scale), softcap)
        kind, size = (group.kind, group.size) if group is not None else (split.context_attention, split.context)
        _took(window, softcap, f"{kind} over mesh.context={size}, blockwise")
        if group is None:
            return sequence_split_attention(q, k, v, positions, segment_ids, visibility, split)
        tokens = token_places(positions, segment_ids, q.shape[:2])
        return local_attention(q, k, v, tokens, tokens, visibility, group)
    backend = lowering_platform()
    band = None if window is None else (window - 1, 0)
    block = blockwise_block(q.shape[1], k.shape[1])
    why = ""
    if backend == "gpu":
        why = _why_not_cudnn(q.dtype, softcap, packed_long=segment_ids is not None and block is not None)
        if not why:
            try:
                attended = jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                                        implementation="cudnn", local_window_size=band,
                                                        mask=None if segment_ids is None else
                                                        _same_segment(segment_ids, segment_ids)[:, None])
                _took(window, softcap, "cuDNN's fused kernel")
                return attended
            except (NotImplementedError, RuntimeError, ValueError) as err:  # a shape, GPU or cuDNN it does not take
                why = f"cuDNN's kernel refused it: {first_line(err)[:160]}"
    if backend == "cpu" and q.dtype == jnp.float16:
        return _attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=is_causal, scale=scale,
                          segment_ids=segment_ids, window=window, softcap=softcap, positions=None).astype(q.dtype)
    if block is not None:
        _took(window, softcap, f"XLA's, in blocks of {block} queries and keys", why)
        return blockwise_attention(q, k, v, block, Visibility(is_causal, window, _scale(q, scale), softcap),
                                   segment_ids)
    causal_cpu = backend == "cpu" and is_causal and q.shape[1] == k.shape[1]
    blocks = query_blocks(q.shape[1], window) if causal_cpu else 1
    _took(window, softcap, "XLA's" if blocks == 1 else f"XLA's, in {blocks} query blocks", why)
    if blocks > 1:
        return causal_attention_in_query_blocks(q, k, v, blocks, scale, segment_ids, window, softcap)
    return dot_attention(q, k, v, is_causal=is_causal, scale=scale, band=band, softcap=softcap,
                         mask=None if segment_ids is None else _same_segment(segment_ids, segment_ids)[:, None])


def blockwise_block(queries: int, keys: int) -> int | None:
    """The block of the blockwise attention (xlatrain/models/blockwise.py) for a self-attention longer than
    BLOCKWISE_AFTER: the largest of BLOCKWISE_BLOCKS that divides the length; None: the attentions below, whose
    largest array is one [length, length] block of scores."""
    if queries != keys or queries <= BLOCKWISE_AFTER:
        return None
    return next((block for block in BLOCKWISE_BLOCKS if queries % block == 0), None)


def _scale(q: jax.Array, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _same_segment(query_segments_BxQ: jax.Array, key_segments_BxK: jax.Array) -> jax.Array:
    """[B, Q, K]: whether each query and key lie in the same packed document."""
    return query_segments_BxQ[:, :, None] == key_segments_BxK[:, None, :]


def _why_not_cudnn(dtype: jnp.dtype, softcap: float | None, packed_long: bool) -> str:
    """Why a GPU's attention of these inputs cannot be cuDNN's fused kernel ("" where it may be)."""
    if dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN's fused kernel takes bfloat16 and float16, not {jnp.dtype(dtype).name}"
    if softcap is not None:
        return "cuDNN's fused kernel has no soft-capping: the scores are capped in XLA's ops"
    if packed_long:
        return (f"packed documents longer than {BLOCKWISE_AFTER} tokens: cuDNN's kernel would take their mask as "
                "one [length, length] array")
    missing = cudnn_missing()
    return "" if missing is None else f"{missing}: {INSTALL_CUDNN}"


def dot_attention(q_BxQxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, *, mask: jax.Array | None = None,
                  scale: float | None = None, is_causal: bool = False, band: tuple[int, int] | None = None,
                  softcap: float | None = None) -> jax.Array:
    """jax.nn.dot_product_attention (XLA's), or where the scores are soft-capped, which it does not do, the same
    written out: scores in float32, tanh(s / c) c, the masks, softmax, the values (grouped-query heads: query head
    h reads key/value head h // (H / G), as jax's)."""
    if softcap is None:
        return jax.nn.dot_product_attention(q_BxQxHxK, k_BxSxGxK, v_BxSxGxK, mask=mask, scale=scale,
                                            is_causal=is_causal, local_window_size=band)
    heads, groups = q_BxQxHxK.shape[2], k_BxSxGxK.shape[2]
    k_BxSxHxK, v_BxSxHxK = (jnp.repeat(x, heads // groups, axis=2) for x in (k_BxSxGxK, v_BxSxGxK))
    scale = _scale(q_BxQxHxK, scale)
    scores_BxHxQxS = jnp.einsum("bqhk,bshk->bhqs", q_BxQxHxK, k_BxSxHxK, preferred_element_type=jnp.float32) * scale
    scores_BxHxQxS = jnp.tanh(scores_BxHxQxS / softcap) * softcap
    queries, keys = q_BxQxHxK.shape[1], k_BxSxGxK.shape[1]
    query_Qx1, key_1xS = jnp.arange(queries)[:, None] + (keys - queries), jnp.arange(keys)[None, :]
    visible = jnp.ones((queries, keys), bool)
    if is_causal:
        visible &= key_1xS <= query_Qx1
    if band is not None:
        visible &= (key_1xS >= query_Qx1 - band[0]) & (key_1xS <= query_Qx1 + band[1])
    visible = visible[None, None] if mask is None else visible[None, None] & mask
    scores_BxHxQxS = jnp.where(visible, scores_BxHxQxS, jnp.finfo(jnp.float32).min)
    weights_BxHxQxS = jax.nn.softmax(scores_BxHxQxS, axis=-1).astype(v_BxSxHxK.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", weights_BxHxQxS, v_BxSxHxK)


def cached_attention(q_BxTxHxK: jax.Array, k_BxTxGxK: jax.Array, v_BxTxGxK: jax.Array, keys_BxSxGxK: jax.Array,
                     values_BxSxGxK: jax.Array, start: jax.Array, window: int | None = None,
                     scale: float | None = None, softcap: float | None = None, padding_B: jax.Array | None = None,
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Decoding: the new tokens' keys and values written into the cache at `start`, then each new query attends
    the cached keys up to its own slot (its `window` latest, when given), past its row's left padding (padding_B,
    None: none). Returns (attended, keys, values)."""
    keys = jax.lax.dynamic_update_slice(keys_BxSxGxK, k_BxTxGxK.astype(keys_BxSxGxK.dtype), (0, start, 0, 0))
    values = jax.lax.dynamic_update_slice(values_BxSxGxK, v_BxTxGxK.astype(values_BxSxGxK.dtype), (0, start, 0, 0))
    queries, length = q_BxTxHxK.shape[1], keys.shape[1]
    visible = sees(start + jnp.arange(queries)[:, None], jnp.arange(length)[None, :], window)[None, None]
    if padding_B is not None:
        visible = visible & (jnp.arange(length)[None, :] >= padding_B[:, None])[:, None, None, :]
    attended = dot_attention(q_BxTxHxK, keys, values, mask=visible, scale=scale, softcap=softcap)
    return attended, keys, values


def causal_attention_in_query_blocks(q: jax.Array, k: jax.Array, v: jax.Array, blocks: int,
                                     scale: float | None = None, segment_ids: jax.Array | None = None,
                                     window: int | None = None, softcap: float | None = None) -> jax.Array:
    """Causal attention as `blocks` attentions of consecutive queries, each over the keys from its first query's
    window (the first key without one) up to its last query (the same result; each query's softmax runs over
    the same keys). `segment_ids` [B, L]: packed documents, each block's mask built from its slice of them."""
    rows = q.shape[1] // blocks
    outputs = []
    for block in range(blocks):
        start, end = block * rows, (block + 1) * rows
        first = 0 if window is None else max(0, start - window + 1)
        sees_key = sees(jnp.arange(start, end)[:, None], jnp.arange(first, end)[None, :], window)[None, None]
        if segment_ids is not None:
            sees_key = sees_key & _same_segment(segment_ids[:, start:end], segment_ids[:, first:end])[:, None]
        outputs.append(dot_attention(q[:, start:end], k[:, first:end], v[:, first:end], mask=sees_key, scale=scale,
                                     softcap=softcap))
    return jnp.concatenate(outputs, axis=1)
