"""The paged step of each mixer: what SALA's layers compute in an engine step, over the pools.

sala/model.py's mixers are the reference ([B, T] batches with a contiguous cache, the path
the tests compare against); in a serving step they compute their projections, norms and gates
as always and hand q, k, v to the step context (sala/engine/context.py), which runs these:

- `sparse_step`: write the step's K/V into the layer's pages (in the layer's format), extend
  the InfLLM-v2 compressed keys, then attend: draft trees (Medusa) over the committed K/V plus
  their ancestors, decode rows in one paged call, prompt chunks causally over the cached
  prefix (past sparse_config.dense_len, InfLLM-v2's selected blocks);
- `lightning_step`: draft trees from the slots' states (never written), decode rows as one
  in-place update of the state pool, prompt chunks in the chunked form from their slots;
- `commit_tree`: after a verify, each accepted path's K/V into the pages and each lightning
  state advanced along it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from kernels.lightning_decode import lightning_decode
from kernels.prefill_attention import prefill_attention
from sala import lightning, lightning_tree, sparse
from sala.kv.pages import decode_attention
from sala.model import causal_mask


# ---------------------------------------------------------------- sparse (minicpm4) layers
def sparse_step(mixer, q, k, v, ctx):
    """A sparse mixer's step: the step's flat rows (q [1, Hq, N, D]) over the paged K/V pool
    (sala/kv/pages.py: each layer's pages in its own format)."""
    k_pages, v_pages = ctx.cache.k[mixer.layer_idx], ctx.cache.v[mixer.layer_idx]
    # Draft trees' rows stay out of the pool (commit_tree writes the accepted paths'): written to
    # the scratch row, they were a pool write before the commit's in the compiled greedy verify
    # step, and for two writes inductor copied every pool whole (9x the step) instead of writing
    # in place.
    first = ctx.tree.num_rows if ctx.tree else 0
    if not ctx.tree or ctx.prefills:
        k_pages.write(ctx.slot_mapping[first:], k[0, :, first:].transpose(0, 1))
        v_pages.write(ctx.slot_mapping[first:], v[0, :, first:].transpose(0, 1))
    compressed = mixer.layer_idx in ctx.cache.k1
    if compressed:
        compress_step(mixer, ctx, k_pages, q.dtype)
    # A quantized cache: prompt chunks attend over what decode will read, not the exact K/V.
    lossless = k_pages.codec.lossless_for(q.dtype) and v_pages.codec.lossless_for(q.dtype)
    scale = mixer.head_dim**-0.5
    outs = [attend_tree(mixer, q, k, v, k_pages, v_pages, ctx.tree)] if ctx.tree else []
    if ctx.num_decode:
        q_dec = q[0, :, : ctx.num_decode].transpose(0, 1)
        sparse_rows = [i for i, (n, p) in enumerate(zip(ctx.context_lens.tolist(), ctx.decode_prompt_lens))
                       if sparse.call_length(n - 1, p) >= mixer.sparse.dense_len] if ctx.decode_prompt_lens else []
        if sparse_rows:
            o = decode_sparse(mixer, q_dec, ctx, k_pages, v_pages, sparse_rows)
        else:
            o = decode_attention(q_dec, k_pages, v_pages, ctx.block_tables, ctx.context_lens, scale)
        outs.append(o.transpose(0, 1))  # [Hq, n_decode, D]
    for span in ctx.prefills:
        end = span.start + span.length
        qs = q[:, :, span.start : end]
        pos = torch.arange(span.past, span.past + span.length, device=q.device)
        dense = sparse.dense_rows(pos, span.prompt_len, mixer.sparse) if compressed else None
        if dense is not None and not bool(dense.all()):
            keys, values, k1, k2 = request_keys(mixer, ctx, k_pages, v_pages, span.kv_rows, q.dtype)
            outs.append(sparse.infllm_v2_attention(qs[0], keys, values, k1, k2, span.past, span.prompt_len,
                                                   mixer.sparse, scale, dense))
            continue
        if span.past == 0 and lossless:  # a fresh prompt: its own K/V, causal flash path
            ks, vs = k[:, :, span.start : end], v[:, :, span.start : end]
        else:
            rows = span.kv_rows if span.past else ctx.slot_mapping[span.start : end]
            ks = k_pages.read(rows, q.dtype).transpose(0, 1)[None]
            vs = v_pages.read(rows, q.dtype).transpose(0, 1)[None]
        if ctx.batch_invariant:  # fixed blocks of absolute positions: cut-independent bits
            outs.append(prefill_attention_in_blocks(qs, ks, vs, span.past, mixer.n_heads != mixer.n_kv))
        else:
            outs.append(prefill_attention(qs[0], ks[0], vs[0]))  # Triton on CUDA, SDPA elsewhere
    return _rows_with_padding(outs, q)


def compress_step(mixer, ctx, k_pages, dtype: torch.dtype) -> None:
    """Add the InfLLM-v2 compressed-key windows this step's keys complete to the pool. Decode
    rows in tensor ops only (a compiled or captured decode step runs this too): each computes
    the window ending at its token and writes it where it belongs, or to scratch if incomplete."""
    cache, ps, nd = ctx.cache, ctx.cache.page_size, ctx.num_decode
    for pool, (size, stride) in zip((cache.k1[mixer.layer_idx], cache.k2[mixer.layer_idx]), mixer.sparse.levels):
        if nd:
            length = ctx.positions[:nd] + 1
            tok = torch.minimum((length - size).clamp(min=0)[:, None] + torch.arange(size, device=length.device),
                                length[:, None] - 1)  # [nd, size] positions, clamped while incomplete
            rows = ctx.block_tables.gather(1, tok // ps) * ps + tok % ps
            complete = (length >= size) & ((length - size) % stride == 0)
            target = torch.where(complete, rows[:, 0] // stride, cache.scratch_row // stride)
            pool.index_copy_(0, target, sparse.window_means(_read_rows(k_pages, rows, dtype)))
        for span in ctx.prefills:
            first = sparse.num_windows(span.past, size, stride)
            n = sparse.num_windows(span.past + span.length, size, stride)
            if n > first:
                starts = torch.arange(first, n, device=span.kv_rows.device) * stride
                rows = span.kv_rows[starts[:, None] + torch.arange(size, device=starts.device)]
                pool.index_copy_(0, rows[:, 0] // stride, sparse.window_means(_read_rows(k_pages, rows, dtype)))


def attend_tree(mixer, q, k, v, k_pages, v_pages, tree):
    """Each tree node over its request's committed K/V and its own ancestors -> [Hq, R*T, D].
    The tree's K/V stay out of the pool (kept in tree.saved for commit_tree)."""
    r, t = tree.num_requests, tree.num_nodes
    qt, kt, vt = (x[0, :, : r * t].unflatten(1, (r, t)).transpose(0, 1) for x in (q, k, v))  # [R, H, T, D]
    tree.saved[mixer.layer_idx] = (kt, vt)
    # The committed K/V as decode reads them (dequantized from the layer's format).
    kc = k_pages.read(tree.kv_rows.flatten(), q.dtype).unflatten(0, tree.kv_rows.shape).transpose(1, 2)  # [R, Hkv, W, D]
    vc = v_pages.read(tree.kv_rows.flatten(), q.dtype).unflatten(0, tree.kv_rows.shape).transpose(1, 2)
    # The nodes' own K/V as plain decode would read them back: through the layer's format.
    kt, vt = (_through_format(x, pages, q.dtype) for x, pages in ((kt, k_pages), (vt, v_pages)))
    committed = torch.arange(tree.kv_rows.shape[1], device=q.device)[None] < tree.kv_lens[:, None]  # [R, W]
    mask = torch.cat([committed[:, None].expand(r, t, -1), tree.ancestor_mask.expand(r, t, t)], dim=-1)
    # In fp32, as the decode path's paged attention is, so that the verified logits are the decoded ones.
    o = F.scaled_dot_product_attention(qt.float(), torch.cat([kc, kt], 2).float(), torch.cat([vc, vt], 2).float(),
                                       attn_mask=mask[:, None], enable_gqa=mixer.n_heads != mixer.n_kv)
    return o.to(q.dtype).transpose(0, 1).flatten(1, 2)


def commit_sparse_tree(mixer, ctx, nodes: torch.Tensor, dest_rows: torch.Tensor) -> None:
    """Write nodes' K/V (nodes [M] flat indices r * T + i) at pool rows dest_rows [M] (the scratch row for
    nodes not accepted)."""
    kt, vt = ctx.tree.saved.pop(mixer.layer_idx)
    for saved, pages in ((kt, ctx.cache.k[mixer.layer_idx]), (vt, ctx.cache.v[mixer.layer_idx])):
        pages.write(dest_rows, saved.transpose(1, 2).flatten(0, 1)[nodes])  # [M, Hkv, D], quantized by the format


def request_keys(mixer, ctx, k_pages, v_pages, kv_rows: torch.Tensor, dtype):
    """One request's keys and values [L, Hkv, D] and compressed keys K1 / K2 from the pools."""
    cache, n = ctx.cache, kv_rows.shape[0]
    k1, k2 = (pool[kv_rows[torch.arange(sparse.num_windows(n, size, stride), device=kv_rows.device) * stride] // stride]
              for pool, (size, stride) in zip((cache.k1[mixer.layer_idx], cache.k2[mixer.layer_idx]), mixer.sparse.levels))
    return k_pages.read(kv_rows, dtype), v_pages.read(kv_rows, dtype), k1, k2


def decode_sparse(mixer, q_dec, ctx, k_pages, v_pages, sparse_rows: list[int]) -> torch.Tensor:
    """Decode rows [n_decode, Hq, D]: the sparse ones one request at a time, the rest batched."""
    o = torch.empty_like(q_dec)
    scale = mixer.head_dim**-0.5
    dense = [i for i in range(q_dec.shape[0]) if i not in set(sparse_rows)]
    if dense:
        idx = torch.tensor(dense, device=q_dec.device)
        o[idx] = decode_attention(q_dec[idx], k_pages, v_pages, ctx.block_tables[idx], ctx.context_lens[idx], scale)
    ps = ctx.cache.page_size
    for i in sparse_rows:
        n = int(ctx.context_lens[i])
        pos = torch.arange(n, device=q_dec.device)
        kv_rows = ctx.block_tables[i, pos // ps] * ps + pos % ps
        keys, values, k1, k2 = request_keys(mixer, ctx, k_pages, v_pages, kv_rows, q_dec.dtype)
        o[i] = sparse.infllm_v2_attention(q_dec[i][:, None], keys, values, k1, k2, n - 1, ctx.decode_prompt_lens[i],
                                          mixer.sparse, scale)[:, 0]
    return o


def _read_rows(pages, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows of any shape [...] -> their dequantized values [..., H, D]."""
    return pages.read(rows.reshape(-1), dtype).unflatten(0, rows.shape)


def _through_format(x: torch.Tensor, pages, dtype: torch.dtype) -> torch.Tensor:
    """x [R, H, T, D] quantized and dequantized by a KVPages' codec (unchanged for a lossless one)."""
    if pages.codec.lossless_for(dtype):
        return x
    rows = x.transpose(1, 2).flatten(0, 1)  # [R*T, H, D]
    return pages.codec.decode(*pages.codec.encode(rows), dtype).unflatten(0, x.shape[::2]).transpose(1, 2)


def prefill_attention_in_blocks(q, k, v, past: int, gqa: bool) -> torch.Tensor:
    """Causal attention of prompt positions past .. past + Tq (q [1, Hq, Tq, D]) over keys 0 ..
    past + Tq (k, v [1, Hkv, past + Tq, D]), one call per block of lightning.CHUNK_SIZE absolute
    positions, each over the keys up to its block's end -> [Hq, Tq, D].

    The evaluation mode's attention: SDPA's CPU kernel tiles queries and keys by sizes it picks
    from the call's lengths (query tiles of 32 below 192 queries, 64 above; a key tile of
    min(512, keys)), so a position's output changed with how long its chunk was: a 300-token
    prompt prefilled in one chunk and in chunks of 256 + 44 differed from position 128 on.
    Here a block's call depends only on its absolute positions, and the scheduler cuts prompts
    only at multiples of CHUNK_SIZE, so every cut computes each position with the same call."""
    block = lightning.CHUNK_SIZE
    outs = []
    for a in range(past, past + q.shape[2], block):
        b = min((a // block + 1) * block, past + q.shape[2])
        mask = causal_mask(b - a, b, a, None, q.device)
        o = F.scaled_dot_product_attention(q[:, :, a - past : b - past], k[:, :, :b], v[:, :, :b], attn_mask=mask,
                                           enable_gqa=gqa)
        outs.append(o[0])
    return torch.cat(outs, 1)


def _rows_with_padding(outs: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Per-part outputs [H, rows, D] in row order -> [1, H, N, D]; rows past the last part are
    padding (rows added only to round the batch up) and get zeros."""
    covered = sum(o.shape[1] for o in outs)
    n = like.shape[2]
    if covered < n:
        outs.append(like.new_zeros(like.shape[1], n - covered, like.shape[3]))
    return torch.cat(outs, dim=1)[None] if len(outs) > 1 else outs[0][None]


# ---------------------------------------------------------------- lightning layers
def lightning_step(mixer, q, k, v, g, ctx):
    """A lightning mixer's step: the step's flat rows (fp32 q, k, v [1, H, N, D]) against the
    state pool, updated in place by slot."""
    states = ctx.cache.states[mixer.layer_idx]  # [slots, H, Dk, Dv]
    outs = []
    if tree := ctx.tree:  # read the slots' states, never write them (commit_tree does)
        qt, kt, vt = (x[0, :, : tree.num_rows].unflatten(1, (tree.num_requests, -1)).transpose(0, 1) for x in (q, k, v))
        committed = states.index_select(0, tree.state_slots).float()
        if states.dtype == torch.float32:
            tree.saved[mixer.layer_idx] = (kt, vt)
            o = lightning_tree.tree_parallel(qt, kt, vt, g, mixer.scale, committed, tree.depths, tree.ancestor_mask)
        else:  # states rounded node by node, as decoding rounds them token by token (lightning_tree.tree_scan)
            o, node_states = lightning_tree.tree_scan(qt, kt, vt, g, mixer.scale, committed, tree.parents, tree.depths,
                                                      states.dtype, tree.levels)
            tree.saved[mixer.layer_idx] = (node_states,)
        outs.append(o.transpose(0, 1).flatten(1, 2))
    nd = ctx.num_decode
    if nd:
        q_dec, k_dec, v_dec = (t[0, :, :nd].transpose(0, 1) for t in (q, k, v))  # [n_decode, H, D]
        o = lightning_decode(q_dec, k_dec, v_dec, g, mixer.scale, states, ctx.state_slots)  # states updated in place
        outs.append(o.transpose(0, 1))
    spans = ctx.prefills
    if len(spans) == 1 or (spans and ctx.batch_invariant):
        # One span at a time: the exact shapes a request would see alone.
        for span in spans:
            part = slice(span.start, span.start + span.length)
            o, s = lightning.chunked(q[:, :, part], k[:, :, part], v[:, :, part], g, mixer.scale,
                                     states[span.state_slot][None].float())
            states[span.state_slot] = s[0]
            outs.append(o[0])
    elif spans:
        # Several prompt chunks as one zero-padded batch, each from its own state.
        first, lengths = spans[0].start, [s.length for s in spans]
        padded = [pad_sequence(t[0, :, first : first + sum(lengths)].transpose(0, 1).split(lengths), batch_first=True)
                  .transpose(1, 2) for t in (q, k, v)]  # [R, H, T_max, D]
        o, s = lightning.chunked(*padded, g, mixer.scale, states.index_select(0, ctx.prefill_state_slots).float(),
                                 lengths=ctx.prefill_lengths)
        states.index_copy_(0, ctx.prefill_state_slots, s.to(states.dtype))
        outs += [o[i, :, :n] for i, n in enumerate(lengths)]
    return _rows_with_padding(outs, q)


def commit_lightning_tree(mixer, ctx, paths: torch.Tensor, lengths: torch.Tensor) -> None:
    """Advance each request's state along its accepted path (paths [R, P] node indices, root
    first; lengths [R] nodes accepted): in closed form, or, for a BF16-state layer, to the
    last accepted node's state from the verify's scan."""
    saved = ctx.tree.saved.pop(mixer.layer_idx)
    states, slots = ctx.cache.states[mixer.layer_idx], ctx.tree.state_slots
    if len(saved) == 1:  # every node's state (a BF16-state layer): the last accepted node's
        last = paths.gather(1, (lengths - 1)[:, None])[:, 0]
        new = saved[0][torch.arange(paths.shape[0], device=paths.device), :, last]
    else:
        kt, vt = saved
        g = mixer.consts.get("log_decay", kt.device)
        new = lightning_tree.commit_path(kt, vt, g, states.index_select(0, slots).float(), paths, lengths)
    states.index_copy_(0, slots, new.to(states.dtype))


# ---------------------------------------------------------------- after a tree verify
def commit_tree(model, ctx, paths: torch.Tensor, lengths: torch.Tensor, dest_rows: torch.Tensor) -> None:
    """After a tree-verify forward with step context `ctx`: commit each request's accepted path (paths [R, P] node
    indices root first, lengths [R]) into the pools; dest_rows [R, P] are the pool rows of the path's positions,
    the scratch row past each request's length (TreeStep.path_rows). Fixed shapes, no host sync: the compiled
    verify step commits in its own graph."""
    t = ctx.tree.num_nodes
    nodes = (paths.clamp(min=0) + t * torch.arange(paths.shape[0], device=paths.device)[:, None]).flatten()
    for layer in model.layers:
        if layer.is_lightning:
            commit_lightning_tree(layer.self_attn, ctx, paths, lengths)
        else:
            commit_sparse_tree(layer.self_attn, ctx, nodes, dest_rows.flatten())
